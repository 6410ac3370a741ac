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
    /// Requests completed in the run.
    pub requests: u64,
    /// CPU time (user + system) the server under test spent per request, in microseconds,
    /// when its process could be read: a figure the machine's other load moves less than
    /// requests per second.
    pub cpu_us_per_request: Option<f64>,
}

/// Reads the CPU time (user + system) spent so far by the server under test.
pub type CpuClock<'a> = &'a (dyn Fn() -> Option<Duration> + Sync);

/// Runs `wrk` with one thread and `connections` keep-alive connections against `url`; with
/// `cpu`, the server's CPU time per request is read around the run.
pub async fn run(
    program: &str,
    url: &str,
    connections: usize,
    duration: Duration,
    cpu: Option<CpuClock<'_>>,
) -> Result<WrkRun, String> {
    let before = cpu.and_then(|read| read());
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
    let after = cpu.and_then(|read| read());
    let mut run = parse(&text, connections).ok_or_else(|| format!("unexpected {program} output: {text}"))?;
    if let (Some(before), Some(after)) = (before, after) {
        if run.requests > 0 {
            run.cpu_us_per_request = Some(after.saturating_sub(before).as_secs_f64() * 1e6 / run.requests as f64);
        }
    }
    Ok(run)
}

/// `wrk` on each of `urls` in rounds whose order rotates (`a b c`, `b c a`, `c a b`, …), so
/// that a change in the machine's load during the phase falls on all of them: per URL,
/// throughput is the mean of its rounds, latency percentiles their median.
pub async fn alternate(
    program: &str,
    urls: &[(&str, Option<CpuClock<'_>>)],
    connections: usize,
    duration: Duration,
    rounds: usize,
) -> Vec<Result<WrkRun, String>> {
    let mut runs: Vec<Vec<Result<WrkRun, String>>> = urls.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds.max(1) {
        for k in 0..urls.len() {
            let i = (round + k) % urls.len();
            let (url, cpu) = urls[i];
            runs[i].push(run(program, url, connections, duration, cpu).await);
        }
    }
    runs.into_iter().map(combine).collect()
}

fn combine(runs: Vec<Result<WrkRun, String>>) -> Result<WrkRun, String> {
    let runs: Vec<WrkRun> = runs.into_iter().collect::<Result<_, _>>()?;
    let first = runs.first().ok_or("no wrk run")?;
    let median = |f: fn(&WrkRun) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let requests: u64 = runs.iter().map(|r| r.requests).sum();
    // All rounds' CPU over all their requests (none when a round could not be read).
    let cpu_us_per_request = runs
        .iter()
        .map(|r| r.cpu_us_per_request.map(|us| us * r.requests as f64))
        .sum::<Option<f64>>()
        .filter(|_| requests > 0)
        .map(|us| us / requests as f64);
    Ok(WrkRun {
        connections: first.connections,
        per_sec: runs.iter().map(|r| r.per_sec).sum::<f64>() / runs.len() as f64,
        p50_ms: median(|r| r.p50_ms),
        p99_ms: median(|r| r.p99_ms),
        requests,
        cpu_us_per_request,
    })
}

fn parse(text: &str, connections: usize) -> Option<WrkRun> {
    let mut per_sec = None;
    let mut p50 = None;
    let mut p99 = None;
    let mut requests = None;
    for line in text.lines().map(str::trim) {
        // `123456 requests in 3.00s, 187.31MB read`
        if let Some((n, _)) = line.split_once(" requests in ") {
            requests = n.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("Requests/sec:") {
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
        requests: requests?,
        cpu_us_per_request: None,
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
        assert_eq!(run.requests, 12000);
        assert_eq!(millis("1.5s"), Some(1500.0));
        assert_eq!(millis("abc"), None);
    }

    #[test]
    fn alternated_rounds_average_throughput_and_take_median_latency() {
        let run = |per_sec: f64, p50_ms, p99_ms| {
            Ok(WrkRun {
                connections: 4,
                per_sec,
                p50_ms,
                p99_ms,
                requests: per_sec as u64,
                cpu_us_per_request: Some(1e6 / per_sec),
            })
        };
        let combined =
            combine(vec![run(100.0, 1.0, 9.0), run(400.0, 3.0, 5.0), run(100.0, 2.0, 7.0)]).expect("combined");
        assert!((combined.per_sec - 200.0).abs() < 1e-9);
        assert!((combined.p50_ms - 2.0).abs() < 1e-9);
        assert!((combined.p99_ms - 7.0).abs() < 1e-9);
        // 3 s of CPU over 600 requests, not the mean of the rounds' figures.
        assert_eq!(combined.requests, 600);
        assert!((combined.cpu_us_per_request.expect("cpu") - 5_000.0).abs() < 1e-6);
        assert!(combine(vec![run(1.0, 1.0, 1.0), Err("wrk failed".into())]).is_err());
        assert!(combine(Vec::new()).is_err());
    }
}
