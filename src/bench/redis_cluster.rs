//! The `cluster` phase: uncontended appends over many sessions through a proxy on one Redis
//! and through a proxy on a Redis Cluster of three primaries (no replicas), each its own
//! `redis-server` processes started for the run, measured one after the other in the same
//! run, against the same store. Figures, not a pass/fail test.

use std::path::Path;
use std::time::Duration;

use super::load::{Http, Phase};
use super::procs::{self, Child};
use super::redis_tls::{appends, proxy, side_by_side, Scratch};
use super::{BenchError, Plan, Stats};

/// Hard cap on one worker's operations in a phase, whatever its duration.
const MAX_OPS_PER_WORKER: u64 = 1_000_000;
/// How long the three nodes may take to agree on the layout.
const CLUSTER_READY_WITHIN: Duration = Duration::from_secs(20);

/// Uncontended appends at one concurrency, one Redis vs a three-primary cluster.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ClusterRow {
    pub concurrency: usize,
    pub single: Stats,
    pub cluster: Stats,
}

/// A loopback port whose cluster bus port (+10000) is free too.
fn cluster_port(taken: &[u16]) -> Result<u16, BenchError> {
    for _ in 0..2000 {
        let port = 20000 + rand::random::<u16>() % 35000;
        if taken
            .iter()
            .any(|t| *t == port || *t + 10000 == port || *t == port + 10000)
        {
            continue;
        }
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10000) {
            return Ok(port);
        }
    }
    Err(BenchError::Start("no free port pair for a cluster node".into()))
}

/// Runs the phase.
pub async fn measure(exe: &Path, redis_server: &str, plan: &Plan) -> Result<Vec<ClusterRow>, BenchError> {
    if !procs::installed(redis_server, "--version") {
        return Err(BenchError::Missing(format!("{redis_server} not found")));
    }
    let cli = Path::new(redis_server).with_file_name("redis-cli");
    let cli = if cli.exists() {
        cli
    } else {
        Path::new("redis-cli").to_path_buf()
    };
    if !procs::installed(&cli.to_string_lossy(), "--version") {
        return Err(BenchError::Missing(format!("{} not found", cli.display())));
    }
    let dir = Scratch(std::env::temp_dir().join(format!("turnlock-bench-cluster-{}", std::process::id())));
    let mut nodes = Vec::new();
    let mut ports = Vec::new();
    for i in 0..3 {
        let port = cluster_port(&ports)?;
        ports.push(port);
        let node_dir = dir.0.join(format!("n{i}"));
        std::fs::create_dir_all(&node_dir).map_err(|e| BenchError::Start(format!("scratch directory: {e}")))?;
        let args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--dir",
            &node_dir.to_string_lossy(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        nodes.push(Child::spawn("redis-server (cluster node)", Path::new(redis_server), &args, addr).await?);
    }
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let created = std::process::Command::new(&cli)
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .map_err(|e| BenchError::Missing(format!("{}: {e}", cli.display())))?;
    if !created.status.success() {
        return Err(BenchError::Start(format!(
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&created.stdout)
        )));
    }
    wait_cluster_ok(&ports).await?;

    let single = procs::redis(redis_server).await?;
    let store = procs::store(exe).await?;
    let single_proxy = proxy(exe, "one Redis", store.addr, &[format!("redis://{}", single.addr)]).await?;
    let cluster_proxy = proxy(
        exe,
        "a cluster",
        store.addr,
        &[format!("redis+cluster://{}", addrs.join(","))],
    )
    .await?;

    let http = Http::new();
    let mut rows = Vec::new();
    for &c in &plan.write_levels {
        let phase = Phase {
            workers: c,
            warmup: plan.warmup,
            measure: plan.measure,
            max_ops_per_worker: MAX_OPS_PER_WORKER,
        };
        let one = appends(phase, &http, &single_proxy, &format!("one-redis-{c}")).await;
        let three = appends(phase, &http, &cluster_proxy, &format!("cluster-{c}")).await;
        rows.push(ClusterRow {
            concurrency: c,
            single: one,
            cluster: three,
        });
    }
    drop(nodes);
    Ok(rows)
}

/// Waits (bounded) until every node says `cluster_state:ok`.
async fn wait_cluster_ok(ports: &[u16]) -> Result<(), BenchError> {
    let until = tokio::time::Instant::now() + CLUSTER_READY_WITHIN;
    while tokio::time::Instant::now() < until {
        let mut ok = 0;
        for port in ports {
            let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}")) else {
                continue;
            };
            let Ok(mut c) = client.get_multiplexed_async_connection().await else {
                continue;
            };
            let info: Result<String, _> = redis::cmd("CLUSTER").arg("INFO").query_async(&mut c).await;
            if info.is_ok_and(|i| i.contains("cluster_state:ok")) {
                ok += 1;
            }
        }
        if ok == ports.len() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(BenchError::Start(format!(
        "the cluster did not reach cluster_state:ok within {CLUSTER_READY_WITHIN:?}"
    )))
}

/// The phase's rows for the printed table (empty when it did not run).
pub fn table(rows: &[ClusterRow]) -> String {
    side_by_side(
        "Uncontended writes over many sessions: one Redis vs a Redis Cluster of 3 primaries (same store, same run)",
        rows.iter()
            .map(|r| (r.concurrency, [("one", &r.single), ("cluster", &r.cluster)])),
    )
}
