//! Pass-through figures from an external load generator, `wrk`, so they are not only
//! measured by the benchmark's own client.

use std::time::Duration;

/// What one `wrk` run reported.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WrkRun {
    pub connections: usize,
    pub per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// Runs `wrk` with one thread and `connections` keep-alive connections against `url`.
pub async fn run(program: &str, url: &str, connections: usize, duration: Duration) -> Result<WrkRun, String> {
    let secs = duration.as_secs().max(1);
    let output = tokio::process::Command::new(program)
        .args([
            "-t1",
            &format!("-c{connections}"),
            &format!("-d{secs}s"),
            "--latency",
            url,
        ])
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!("{program} failed ({}): {text}", output.status));
    }
    parse(&text, connections).ok_or_else(|| format!("unexpected {program} output: {text}"))
}

fn parse(text: &str, connections: usize) -> Option<WrkRun> {
    let mut per_sec = None;
    let mut p50 = None;
    let mut p99 = None;
    for line in text.lines().map(str::trim) {
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            per_sec = v.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("50%") {
            p50 = millis(v.trim());
        } else if let Some(v) = line.strip_prefix("99%") {
            p99 = millis(v.trim());
        }
    }
    Some(WrkRun {
        connections,
        per_sec: per_sec?,
        p50_ms: p50?,
        p99_ms: p99?,
    })
}

/// `123.45us`, `1.20ms`, `2.00s` → milliseconds.
fn millis(v: &str) -> Option<f64> {
    let split = v.find(|c: char| c.is_ascii_alphabetic())?;
    let (num, unit) = v.split_at(split);
    let n: f64 = num.parse().ok()?;
    Some(match unit {
        "us" => n / 1000.0,
        "ms" => n,
        "s" => n * 1000.0,
        "m" => n * 60_000.0,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_latency_distribution_is_read_in_milliseconds() {
        let out = "Running 1s test @ http://127.0.0.1:1/x\n  1 threads and 16 connections\n  \
                   Latency Distribution\n     50%  120.00us\n     75%  200.00us\n     90%    1.10ms\n     \
                   99%    2.50ms\n  12000 requests in 1.00s, 3.00MB read\nRequests/sec:  11987.65\n";
        let run = parse(out, 16).expect("parsed");
        assert_eq!(run.connections, 16);
        assert!((run.per_sec - 11987.65).abs() < 1e-6);
        assert!((run.p50_ms - 0.12).abs() < 1e-9);
        assert!((run.p99_ms - 2.5).abs() < 1e-9);
        assert_eq!(millis("1.5s"), Some(1500.0));
        assert_eq!(millis("abc"), None);
    }
}
