//! `turnlock bench`: turnlock measured side by side, in one run, with going straight to the
//! store and with the client-side locks agents use today.
//!
//! It starts everything on loopback by itself: a `redis-server`, a `turnlock store` and three
//! `turnlock proxy` processes (real processes, so their memory and CPU can be read from
//! `/proc`). Then, in order: the proxy's memory idle and with many open connections; reads
//! passed through vs straight to the store (its own client and `wrk`); uncontended appends
//! through turnlock vs an unsafe GET-modify-PUT; and one hot session written by many writers
//! through the three proxies vs the naive and the backoff-polling lock. It prints a table,
//! writes the figures as JSON, and checks them against the targets in the design.

mod baselines;
mod compaction;
mod histograms;
mod load;
mod phases;
mod procs;
mod redis_cluster;
mod redis_tls;
mod wrk;

pub use self::load::Stats;
pub use self::procs::Machine;
pub use self::redis_cluster::ClusterRow;
pub use self::redis_tls::TlsRow;
pub use self::wrk::WrkRun;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::Serialize;

/// `turnlock bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// A short run (about a second per phase, fewer levels) for CI smoke checks.
    #[arg(long)]
    pub quick: bool,
    /// Seconds each measured phase runs (default 3; 1 with --quick).
    #[arg(long)]
    pub phase_secs: Option<f64>,
    /// Where the machine-readable result is written.
    #[arg(long, default_value = "turnlock-bench.json")]
    pub out: PathBuf,
    /// The redis-server binary to start.
    #[arg(long, env = "TURNLOCK_REDIS_SERVER", default_value = "redis-server")]
    pub redis_server: String,
    /// The wrk binary for the external pass-through figures (skipped when not installed).
    #[arg(long, default_value = "wrk")]
    pub wrk: String,
    /// The nginx binary run as a pass-through peer (skipped, saying so, when not installed).
    #[arg(long, default_value = "nginx")]
    pub nginx: String,
    /// Run only these phases (comma-separated: resources, pass, write, hot, redis-tls,
    /// cluster); all by default.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
}

/// The phases a run can be limited to with `--only`.
const PHASES: [&str; 6] = ["resources", "pass", "write", "hot", "redis-tls", "cluster"];

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Missing(String),
    #[error("cannot start {0}")]
    Start(String),
    #[error("{0}")]
    Failed(String),
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub quick: bool,
    /// Seconds each measured phase ran.
    pub phase_secs: f64,
    pub passthrough: Vec<PassRow>,
    pub uncontended: Vec<WriteRow>,
    pub hot: Vec<HotRow>,
    pub resources: Option<Resources>,
    pub targets: Vec<Target>,
    /// Uncontended appends with Redis over TLS and over plaintext (phase `redis-tls`).
    pub redis_tls: Vec<TlsRow>,
    /// Uncontended appends over one Redis and over a three-primary cluster (phase `cluster`).
    pub redis_cluster: Vec<ClusterRow>,
}

/// GET of one document, straight to the store and through a proxy.
#[derive(Debug, Clone, Serialize)]
pub struct PassRow {
    pub concurrency: usize,
    pub direct: Stats,
    pub proxy: Stats,
    /// nginx as the pass-through peer (one worker, keep-alive to the store), when installed.
    pub nginx: Option<Stats>,
    pub wrk_direct: Option<WrkRun>,
    pub wrk_proxy: Option<WrkRun>,
    /// A proxy on one worker thread (`--worker-threads 1`), as nginx runs one worker.
    pub wrk_proxy_one_thread: Option<WrkRun>,
    pub wrk_nginx: Option<WrkRun>,
    /// `examples/hyper_floor`, when built: hyper with no work on the request, the least a
    /// proxy built on hyper costs (a reference, not a target).
    pub wrk_floor: Option<WrkRun>,
}

/// Appends, each writer on its own sessions: through a proxy, and as a plain GET-modify-PUT
/// straight to the store.
#[derive(Debug, Clone, Serialize)]
pub struct WriteRow {
    pub concurrency: usize,
    pub direct: Stats,
    pub proxy: Stats,
    /// Redis commands the proxy sent per write (all of them, whether pipelined or not).
    pub redis_commands_per_write: f64,
    /// The proxy's CPU time (user + system) per 1,000 writes.
    pub proxy_cpu_ms_per_1000: f64,
    /// Growth of Redis's `used_memory` per write (locks, fences, version snapshots, records
    /// that are still alive after the writes).
    pub redis_bytes_per_write: f64,
}

/// One session written by `writers` concurrent writers with one design.
#[derive(Debug, Clone, Serialize)]
pub struct HotRow {
    pub writers: usize,
    pub design: String,
    /// `steady` (each writer writes again as soon as answered) or `bursts` (rounds of one
    /// write per writer).
    pub load: String,
    /// `growing` (the document grows by every write) or `compacted` (compacted every 100 ms
    /// down to its last 200 messages, as agents do).
    pub doc: String,
    pub stats: Stats,
    /// Retryable answers (503: `session_busy`, `write_conflict`, …; each retried by the writer).
    pub busy: u64,
    /// Writes acknowledged over the whole phase, warm-up included.
    pub acked_total: u64,
    /// Acknowledged writes missing from the final document.
    pub lost: u64,
    /// Messages stored more than once.
    pub duplicated: u64,
    /// Mean writes merged into one read-merge-write (turnlock only, as are the means below).
    pub mean_batch: Option<f64>,
    /// Mean time a leader waited for the session lock.
    pub mean_lock_wait_ms: Option<f64>,
    /// Mean time the lock was held (one read-merge-write of a batch).
    pub mean_lock_hold_ms: Option<f64>,
    /// Mean time of the store's GET and PUT, as the proxies saw them.
    pub mean_store_get_ms: Option<f64>,
    pub mean_store_put_ms: Option<f64>,
    /// CPU time of all proxies per 1,000 acknowledged writes (turnlock only).
    pub cpu_ms_per_1000: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Resources {
    pub rss_idle_mib: f64,
    pub open_connections: usize,
    pub rss_open_connections_mib: f64,
}

/// A target from the design, and whether this run met it.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub figure: String,
    pub target: String,
    pub measured: String,
    pub met: bool,
}

impl Report {
    /// Acknowledged writes that turnlock lost (must be 0).
    pub fn lost_writes(&self) -> u64 {
        self.hot
            .iter()
            .filter(|r| r.design == phases::TURNLOCK)
            .map(|r| r.lost + r.duplicated)
            .sum()
    }
}

/// What a run measures, and for how long.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub measure: Duration,
    pub warmup: Duration,
    pub pass_levels: Vec<usize>,
    pub write_levels: Vec<usize>,
    pub hot_levels: Vec<usize>,
    pub connections: usize,
    pub proxies: usize,
}

impl Plan {
    fn from(args: &BenchArgs) -> Self {
        let secs = args
            .phase_secs
            .unwrap_or(if args.quick { 1.0 } else { 3.0 })
            .clamp(0.2, 60.0);
        let measure = Duration::from_secs_f64(secs);
        if args.quick {
            Self {
                measure,
                warmup: Duration::from_millis(200),
                pass_levels: vec![1, 16, 64],
                write_levels: vec![1, 16],
                hot_levels: vec![32],
                connections: 1000,
                proxies: 3,
            }
        } else {
            Self {
                measure,
                warmup: Duration::from_millis(500),
                pass_levels: vec![1, 16, 64],
                write_levels: vec![1, 16],
                hot_levels: vec![8, 32, 128],
                connections: 1000,
                proxies: 3,
            }
        }
    }
}

/// Runs the whole benchmark and writes the JSON result to `args.out`.
pub async fn run(args: BenchArgs) -> Result<Report, BenchError> {
    let plan = Plan::from(&args);
    let exe = std::env::current_exe().map_err(|e| BenchError::Start(format!("cannot find this executable: {e}")))?;
    let wanted = |phase: &str| args.only.is_empty() || args.only.iter().any(|p| p == phase);
    if let Some(unknown) = args.only.iter().find(|p| !PHASES.contains(&p.as_str())) {
        return Err(BenchError::Failed(format!(
            "unknown phase {unknown:?}; phases are {}",
            PHASES.join(", ")
        )));
    }
    let rig = phases::Rig::start(&exe, &args.redis_server, plan.proxies).await?;
    let resources = match wanted("resources") {
        true => Some(rig.resources(plan.connections).await?),
        false => None,
    };
    let passthrough = match wanted("pass") {
        true => rig.passthrough(&plan, &args.wrk, &args.nginx).await?,
        false => Vec::new(),
    };
    let uncontended = match wanted("write") {
        true => rig.uncontended(&plan).await?,
        false => Vec::new(),
    };
    let hot = match wanted("hot") {
        true => rig.hot(&plan).await?,
        false => Vec::new(),
    };
    drop(rig);
    let redis_tls = match wanted("redis-tls") {
        true => redis_tls::measure(&exe, &args.redis_server, &plan).await?,
        false => Vec::new(),
    };
    let redis_cluster = match wanted("cluster") {
        true => match redis_cluster::measure(&exe, &args.redis_server, &plan).await {
            // Without redis-cli (Debian's redis-tools) the cluster cannot be formed: the
            // phase is skipped, saying so, like the other optional tools' figures.
            Err(BenchError::Missing(what)) if !args.only.iter().any(|p| p == "cluster") => {
                eprintln!("(no cluster rows: {what}; `apt-get install -y redis-tools`)");
                Vec::new()
            }
            other => other?,
        },
        false => Vec::new(),
    };
    let mut report = Report {
        machine: procs::machine(),
        quick: args.quick,
        phase_secs: plan.measure.as_secs_f64(),
        passthrough,
        uncontended,
        hot,
        resources,
        targets: Vec::new(),
        redis_tls,
        redis_cluster,
    };
    report.targets = targets(&report);
    let json = serde_json::to_vec_pretty(&report).map_err(|e| BenchError::Failed(e.to_string()))?;
    std::fs::write(&args.out, json)
        .map_err(|e| BenchError::Failed(format!("cannot write {}: {e}", args.out.display())))?;
    Ok(report)
}

fn targets(r: &Report) -> Vec<Target> {
    let mut out = Vec::new();
    if let Some(row) = r.passthrough.iter().min_by_key(|p| p.concurrency) {
        let added = row.proxy.p50_ms - row.direct.p50_ms;
        out.push(Target {
            figure: format!("pass-through p50 added (1 client x{})", row.concurrency),
            target: "<= 0.05 ms".into(),
            measured: format!("{:.3} ms ({:.3} vs {:.3})", added, row.proxy.p50_ms, row.direct.p50_ms),
            met: added <= 0.05,
        });
    }
    for row in &r.passthrough {
        let (proxy, nginx, tool) = match (&row.wrk_proxy, &row.wrk_nginx, &row.nginx) {
            (Some(p), Some(n), _) => (p.per_sec, n.per_sec, "wrk"),
            (_, _, Some(n)) => (row.proxy.per_sec, n.per_sec, "own client"),
            _ => continue,
        };
        let ratio = proxy / nginx.max(1e-9);
        out.push(Target {
            figure: format!(
                "pass-through vs nginx ({tool}, {} connections, default threads)",
                row.concurrency
            ),
            target: ">= 1.0x nginx".into(),
            measured: format!("{ratio:.2}x ({proxy:.0} vs {nginx:.0} req/s)"),
            met: ratio >= 1.0,
        });
        if let (Some(one), Some(nginx)) = (&row.wrk_proxy_one_thread, &row.wrk_nginx) {
            let ratio = one.per_sec / nginx.per_sec.max(1e-9);
            out.push(Target {
                figure: format!(
                    "pass-through vs nginx (wrk, {} connections, one thread as nginx's one worker)",
                    row.concurrency
                ),
                target: ">= 1.0x nginx".into(),
                measured: format!("{ratio:.2}x ({:.0} vs {:.0} req/s)", one.per_sec, nginx.per_sec),
                met: ratio >= 1.0,
            });
        }
    }
    for row in &r.passthrough {
        let (proxy, direct, tool) = match (&row.wrk_proxy, &row.wrk_direct) {
            (Some(p), Some(d)) => (p.per_sec, d.per_sec, "wrk"),
            _ => (row.proxy.per_sec, row.direct.per_sec, "own client"),
        };
        let ratio = proxy / direct.max(1e-9);
        out.push(Target {
            figure: format!("pass-through throughput ({tool}, {} connections)", row.concurrency),
            target: ">= 0.8x direct".into(),
            measured: format!("{ratio:.2}x ({proxy:.0} vs {direct:.0} req/s)"),
            met: ratio >= 0.8,
        });
    }
    for row in &r.uncontended {
        let ratio = row.proxy.p99_ms / row.direct.p99_ms.max(1e-9);
        out.push(Target {
            figure: format!("uncontended write p99, {} writers", row.concurrency),
            target: "<= 3x direct GET-modify-PUT".into(),
            measured: format!("{ratio:.2}x ({:.2} vs {:.2} ms)", row.proxy.p99_ms, row.direct.p99_ms),
            met: ratio <= 3.0,
        });
    }
    if let Some(row) = r.uncontended.first() {
        out.push(Target {
            figure: "Redis commands per uncontended write".into(),
            target: "~2 (acquire+fence, release)".into(),
            measured: format!("{:.2}", row.redis_commands_per_write),
            met: row.redis_commands_per_write <= 2.05,
        });
    }
    for load in [phases::STEADY, phases::BURSTS] {
        let find = |design: &str| {
            r.hot
                .iter()
                .find(|h| h.writers == 32 && h.design == design && h.load == load && h.doc == phases::GROWING)
        };
        let (Some(t), Some(n), Some(b)) = (find(phases::TURNLOCK), find(phases::NAIVE), find(phases::BACKOFF)) else {
            continue;
        };
        let vs_naive = t.stats.per_sec / n.stats.per_sec.max(1e-9);
        let vs_backoff = t.stats.per_sec / b.stats.per_sec.max(1e-9);
        out.push(Target {
            figure: format!("hot session, 32 writers ({load}), vs naive lock"),
            target: ">= 10x".into(),
            measured: format!(
                "{vs_naive:.1}x ({:.0} vs {:.0} acked/s)",
                t.stats.per_sec, n.stats.per_sec
            ),
            met: vs_naive >= 10.0,
        });
        out.push(Target {
            figure: format!("hot session, 32 writers ({load}), vs backoff lock"),
            target: ">= 3x".into(),
            measured: format!(
                "{vs_backoff:.1}x ({:.0} vs {:.0} acked/s)",
                t.stats.per_sec, b.stats.per_sec
            ),
            met: vs_backoff >= 3.0,
        });
        out.push(Target {
            figure: format!("hot session, 32 writers ({load}), acked writes/s"),
            target: ">= 3000/s".into(),
            measured: format!("{:.0}/s", t.stats.per_sec),
            met: t.stats.per_sec >= 3000.0,
        });
    }
    for h in r.hot.iter().filter(|h| h.design == phases::TURNLOCK && h.writers == 32) {
        let answers = h.acked_total + h.busy + h.stats.failed;
        let pct = h.busy as f64 * 100.0 / answers.max(1) as f64;
        out.push(Target {
            figure: format!("hot session, 32 writers ({}, {}), retryable answers", h.load, h.doc),
            target: "<= 1% of answers".into(),
            measured: format!("{pct:.2}% ({} of {answers}; p99 {:.1} ms)", h.busy, h.stats.p99_ms),
            met: pct <= 1.0,
        });
    }
    let lost: u64 = r
        .hot
        .iter()
        .filter(|h| h.design == phases::TURNLOCK)
        .map(|h| h.lost + h.duplicated)
        .sum();
    if !r.hot.is_empty() {
        out.push(Target {
            figure: "acknowledged writes lost or duplicated (turnlock)".into(),
            target: "0".into(),
            measured: lost.to_string(),
            met: lost == 0,
        });
    }
    if let Some(res) = &r.resources {
        out.push(Target {
            figure: format!("proxy RSS with {} open connections", res.open_connections),
            target: "<= 20 MiB".into(),
            measured: format!("{:.1} MiB", res.rss_open_connections_mib),
            met: res.rss_open_connections_mib <= 20.0,
        });
    }
    out
}

/// The report as the tables the command prints.
pub fn table(r: &Report) -> String {
    let mut s = String::new();
    let m = &r.machine;
    let _ = writeln!(
        s,
        "turnlock bench: {} cores ({}), {} MiB, Linux {}; {:.1} s per phase{}",
        m.cores,
        m.cpu,
        m.memory_mib,
        m.kernel,
        r.phase_secs,
        if r.quick { " (quick)" } else { "" }
    );
    let _ = writeln!(
        s,
        "\nPass-through: GET of one 20-message document (cpu us/req: CPU time of the server wrk loads, per request; the store's on the direct rows)"
    );
    if r.passthrough.first().is_some_and(|p| p.nginx.is_none()) {
        let _ = writeln!(
            s,
            "(nginx not installed: no nginx rows; `apt-get install -y nginx-light`)"
        );
    }
    let _ = writeln!(
        s,
        "{:>5} {:<11} {:>10} {:>8} {:>8} {:>8} | {:>10} {:>8} {:>8} {:>11}",
        "conc", "path", "req/s", "p50 ms", "p99 ms", "p999 ms", "wrk req/s", "wrk p50", "wrk p99", "cpu us/req"
    );
    for p in &r.passthrough {
        let nginx = p.nginx.as_ref().map(|n| ("nginx", Some(n), &p.wrk_nginx));
        for (name, st, w) in [
            ("direct", Some(&p.direct), &p.wrk_direct),
            ("turnlock", Some(&p.proxy), &p.wrk_proxy),
            ("turnlock-1t", None, &p.wrk_proxy_one_thread),
        ]
        .into_iter()
        .chain(nginx)
        .chain(p.wrk_floor.as_ref().map(|_| ("hyper-floor", None, &p.wrk_floor)))
        {
            let own = match st {
                Some(st) => format!(
                    "{:>10.0} {:>8.3} {:>8.3} {:>8.3}",
                    st.per_sec, st.p50_ms, st.p99_ms, st.p999_ms
                ),
                None => format!("{:>10} {:>8} {:>8} {:>8}", "-", "-", "-", "-"),
            };
            let wrk = match w {
                Some(w) => format!(
                    "{:>10.0} {:>8.3} {:>8.3} {:>11}",
                    w.per_sec,
                    w.p50_ms,
                    w.p99_ms,
                    w.cpu_us_per_request.map_or("-".to_owned(), |us| format!("{us:.1}"))
                ),
                None => format!("{:>10} {:>8} {:>8} {:>11}", "-", "-", "-", "-"),
            };
            let _ = writeln!(s, "{:>5} {:<11} {own} | {wrk}", p.concurrency, name);
        }
    }
    // The reference for the nginx rows: what a proxy built on hyper costs with no work at all.
    let floor: Vec<String> = r
        .passthrough
        .iter()
        .filter_map(|p| match (&p.wrk_floor, &p.wrk_nginx) {
            (Some(f), Some(n)) => Some(format!("{:.2}x at {}", f.per_sec / n.per_sec.max(1e-9), p.concurrency)),
            _ => None,
        })
        .collect();
    if !floor.is_empty() {
        let _ = writeln!(
            s,
            "hyper-floor (examples/hyper_floor: hyper with no work on the request) against nginx: {}",
            floor.join(", ")
        );
    }
    let _ = writeln!(
        s,
        "\nUncontended writes: one-message appends, each writer on its own sessions"
    );
    let _ = writeln!(
        s,
        "{:>5} {:<22} {:>9} {:>8} {:>8} {:>8} {:>11} {:>12} {:>13}",
        "conc", "path", "writes/s", "p50 ms", "p99 ms", "p999 ms", "redis cmd/w", "cpu ms/1000w", "redis bytes/w"
    );
    for w in &r.uncontended {
        let _ = writeln!(
            s,
            "{:>5} {:<22} {:>9.0} {:>8.3} {:>8.3} {:>8.3} {:>11} {:>12} {:>13}",
            w.concurrency,
            "direct GET-modify-PUT",
            w.direct.per_sec,
            w.direct.p50_ms,
            w.direct.p99_ms,
            w.direct.p999_ms,
            "-",
            "-",
            "-"
        );
        let _ = writeln!(
            s,
            "{:>5} {:<22} {:>9.0} {:>8.3} {:>8.3} {:>8.3} {:>11.2} {:>12.1} {:>13.0}",
            w.concurrency,
            "turnlock append",
            w.proxy.per_sec,
            w.proxy.p50_ms,
            w.proxy.p99_ms,
            w.proxy.p999_ms,
            w.redis_commands_per_write,
            w.proxy_cpu_ms_per_1000,
            w.redis_bytes_per_write
        );
    }
    let _ = writeln!(
        s,
        "\nHot session: one session, writers spread over {} proxies; its document growing, or compacted every 100 ms to 200 messages",
        3
    );
    let _ = writeln!(
        s,
        "{:<9} {:>7} {:<7} {:<14} {:>9} {:>8} {:>8} {:>7} {:>6} {:>5} {:>6} {:>12} {:>8} {:>8} {:>8} {:>8}",
        "document",
        "writers",
        "load",
        "design",
        "acked/s",
        "p50 ms",
        "p99 ms",
        "retry",
        "failed",
        "lost",
        "batch",
        "cpu ms/1000w",
        "wait ms",
        "hold ms",
        "get ms",
        "put ms"
    );
    let opt = |v: Option<f64>, digits: usize| v.map(|v| format!("{v:.digits$}")).unwrap_or_else(|| "-".into());
    for h in &r.hot {
        let _ = writeln!(
            s,
            "{:<9} {:>7} {:<7} {:<14} {:>9.0} {:>8.2} {:>8.2} {:>7} {:>6} {:>5} {:>6} {:>12} {:>8} {:>8} {:>8} {:>8}",
            h.doc,
            h.writers,
            h.load,
            h.design,
            h.stats.per_sec,
            h.stats.p50_ms,
            h.stats.p99_ms,
            h.busy,
            h.stats.failed,
            h.lost + h.duplicated,
            opt(h.mean_batch, 1),
            opt(h.cpu_ms_per_1000, 1),
            opt(h.mean_lock_wait_ms, 2),
            opt(h.mean_lock_hold_ms, 2),
            opt(h.mean_store_get_ms, 2),
            opt(h.mean_store_put_ms, 2),
        );
    }
    if let Some(res) = &r.resources {
        let _ = writeln!(
            s,
            "\nProxy memory: {:.1} MiB RSS idle, {:.1} MiB with {} open client connections",
            res.rss_idle_mib, res.rss_open_connections_mib, res.open_connections
        );
    }
    s.push_str(&redis_tls::table(&r.redis_tls));
    s.push_str(&redis_cluster::table(&r.redis_cluster));
    let _ = writeln!(s, "\nTargets");
    for t in &r.targets {
        let _ = writeln!(
            s,
            "  [{}] {:<52} target {:<30} measured {}",
            if t.met { "met" } else { "NOT met" },
            t.figure,
            t.target,
            t.measured
        );
    }
    s
}
