//! A bounded soak: steady write and read load across many sessions through a real
//! `turnlock proxy` process. Its memory stays flat, its descriptors and connections do not
//! grow, nothing acknowledged is lost, and no lock key is left in Redis at the end.
//!
//! `TURNLOCK_SOAK_SECS` sets the length (default 120 s).

use std::time::Duration;

use crate::support::ledger::*;
use crate::support::*;

fn proc_status(pid: i32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("status field")
}

fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read /proc fd")
        .count()
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    rss_kb: u64,
    fds: usize,
}

fn sample(pid: i32) -> Sample {
    Sample {
        rss_kb: proc_status(pid, "VmRSS:"),
        fds: open_fds(pid),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_keeps_memory_and_descriptors_flat_and_leaves_no_locks() {
    let secs: u64 = std::env::var("TURNLOCK_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let length = Duration::from_secs(secs.max(10));
    let redis = RedisServer::start();
    let store = store().await;
    let p = ProxyProc::spawn(
        &format!("http://{}", store.addr),
        Some(&redis.url()),
        &[
            "--lock-budget-ms",
            "200",
            "--idempotency-ttl-secs",
            "5",
            "--history-ttl-secs",
            "5",
        ],
    );
    let pid = p.proc.pid();
    let all = sessions("soak", 200);
    let started = tokio::time::Instant::now();
    let writers = Writers::start("soak", vec![p.client()], all.clone(), 8, 1_000_000, length);
    // Readers on their own connections, opened and closed over and over.
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let (addr, all) = (p.addr, all.clone());
            tokio::spawn(async move {
                let mut n = 0usize;
                while started.elapsed() < length && n < 1_000_000 {
                    let c = client(addr);
                    let s = &all[(n * 7 + r) % all.len()];
                    let _ = get_doc(&c, s).await;
                    n += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                n
            })
        })
        .collect();

    // Warm up for a fifth of the run, then sample every few seconds.
    tokio::time::sleep(length / 5).await;
    let warm = sample(pid);
    let mut samples = vec![warm];
    while started.elapsed() < length {
        tokio::time::sleep(Duration::from_secs(5).min(length / 10)).await;
        samples.push(sample(pid));
    }
    let ledger = writers.finish().await;
    let mut reads = 0;
    for r in readers {
        reads += tokio::time::timeout(Duration::from_secs(30), r)
            .await
            .expect("bounded")
            .expect("reader");
    }
    // Idle connections are closed by the clients going away; give the proxy a moment.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let end = sample(pid);
    samples.push(end);
    eprintln!(
        "SOAK {:?}: {} writes acknowledged, {reads} reads; RSS {} kB after warm-up, {} kB at the end (peak {} kB); fds {} -> {} (peak {})",
        length,
        ledger.acked_count(),
        warm.rss_kb,
        end.rss_kb,
        samples.iter().map(|s| s.rss_kb).max().unwrap_or(0),
        warm.fds,
        end.fds,
        samples.iter().map(|s| s.fds).max().unwrap_or(0),
    );
    let counts = check(store.addr, &all, &[&ledger]).await;
    report("soak (steady load, 200 sessions)", &counts);
    assert!(counts.clean(), "{counts:?}");
    assert!(ledger.acked_count() > 0);
    // Flat memory: the second half of the run grows no more than a quarter over the warm level.
    let late_peak = samples[samples.len() / 2..].iter().map(|s| s.rss_kb).max().unwrap_or(0);
    assert!(
        late_peak * 4 <= warm.rss_kb * 5,
        "memory grew from {} kB to {late_peak} kB",
        warm.rss_kb
    );
    assert!(
        end.fds <= warm.fds + 8,
        "descriptors grew from {} to {}",
        warm.fds,
        end.fds
    );
    assert!(
        eventually(Duration::from_secs(5), Duration::from_millis(50), || async {
            redis.lock_keys().is_empty()
        })
        .await
        .is_some(),
        "lock keys left in Redis: {:?}",
        redis.lock_keys()
    );
}
