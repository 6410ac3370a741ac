//! The `redis-tls` phase: uncontended appends through a proxy whose Redis connection is TLS
//! (`rediss://`, certificates made for the run) and through one whose connection is
//! plaintext, to the same `redis-server` (one process serving both ports) and the same store,
//! measured one after the other in the same run.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use http::Method;
use serde_json::json;

use super::baselines;
use super::load::{closed_loop, Http, Phase};
use super::procs::{self, Child};
use super::{BenchError, Plan, Stats};

/// Sessions each writer cycles through (as in the uncontended phase).
const SESSIONS_PER_WRITER: u64 = 8;
/// Hard cap on one worker's operations in a phase, whatever its duration.
const MAX_OPS_PER_WORKER: u64 = 1_000_000;

/// Uncontended appends at one concurrency, Redis over plaintext and over TLS.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TlsRow {
    pub concurrency: usize,
    pub plaintext: Stats,
    pub tls: Stats,
}

/// A directory removed when dropped.
pub(super) struct Scratch(pub(super) PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the phase: its own Redis (plaintext and TLS ports), store and two proxies.
pub async fn measure(exe: &Path, redis_server: &str, plan: &Plan) -> Result<Vec<TlsRow>, BenchError> {
    let dir = Scratch(std::env::temp_dir().join(format!("turnlock-bench-tls-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).map_err(|e| BenchError::Start(format!("scratch directory: {e}")))?;
    let certs = crate::inject::certs::generate(&["localhost".into(), "127.0.0.1".into()], 1)
        .map_err(|e| BenchError::Start(e.to_string()))?;
    let file = |name: &str, pem: &str| -> Result<String, BenchError> {
        let p = dir.0.join(name);
        std::fs::write(&p, pem).map_err(|e| BenchError::Start(format!("{}: {e}", p.display())))?;
        Ok(p.to_string_lossy().into_owned())
    };
    let (ca, cert, key) = (
        file("ca.crt", &certs.ca_cert)?,
        file("tls.crt", &certs.cert)?,
        file("tls.key", &certs.key)?,
    );

    if !procs::installed(redis_server, "--version") {
        return Err(BenchError::Missing(format!("{redis_server} not found")));
    }
    let (plain, tls_addr) = (procs::free_addr()?, procs::free_addr()?);
    let args: Vec<String> = [
        "--port",
        &plain.port().to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--tls-port",
        &tls_addr.port().to_string(),
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "no",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let _redis = Child::spawn("redis-server (TLS)", Path::new(redis_server), &args, plain).await?;
    let store = procs::store(exe).await?;
    let plain_proxy = proxy(exe, "plaintext", store.addr, &[format!("redis://{plain}")]).await?;
    let tls_proxy = proxy(
        exe,
        "TLS",
        store.addr,
        &[format!("rediss://{tls_addr}"), "--redis-ca".into(), ca.clone()],
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
        let plaintext = appends(phase, &http, &plain_proxy, &format!("tls-off-{c}")).await;
        let tls = appends(phase, &http, &tls_proxy, &format!("tls-on-{c}")).await;
        rows.push(TlsRow {
            concurrency: c,
            plaintext,
            tls,
        });
    }
    Ok(rows)
}

/// A proxy with `redis` (the URL, then any flags).
pub(super) async fn proxy(
    exe: &Path,
    name: &str,
    store: std::net::SocketAddr,
    redis: &[String],
) -> Result<Child, BenchError> {
    let (addr, admin) = (procs::free_addr()?, procs::free_addr()?);
    let mut args: Vec<String> = vec![
        "proxy".into(),
        "--listen".into(),
        addr.to_string(),
        "--admin".into(),
        admin.to_string(),
        "--upstream".into(),
        format!("http://{store}"),
        "--redis".into(),
    ];
    args.extend(redis.iter().cloned());
    let mut child = Child::spawn(&format!("proxy (Redis over {name})"), exe, &args, addr).await?;
    child.admin = Some(admin);
    Ok(child)
}

pub(super) async fn appends(phase: Phase, http: &Http, proxy: &Child, tag: &str) -> Stats {
    let (http, url, tag) = (http.clone(), format!("http://{}", proxy.addr), tag.to_owned());
    closed_loop(phase, move |w, seq, _end| {
        let (http, url, tag) = (http.clone(), url.clone(), tag.clone());
        async move {
            let session = format!("{tag}-{w}-{}", seq % SESSIONS_PER_WRITER);
            let body = json!({"turn": 1, "messages": [baselines::message(&format!("w{w}-{seq}"))]});
            let url = format!("{url}/v1/sessions/{session}/messages");
            matches!(
                http.send(Method::POST, &url, Some(Bytes::from(body.to_string())), &[]).await,
                Ok(r) if r.status.is_success()
            )
        }
    })
    .await
}

/// The phase's rows for the printed table (empty when it did not run).
pub fn table(rows: &[TlsRow]) -> String {
    side_by_side(
        "Uncontended writes with Redis over TLS vs plaintext (same redis-server, same store)",
        rows.iter()
            .map(|r| (r.concurrency, [("plaintext", &r.plaintext), ("TLS", &r.tls)])),
    )
}

/// Two Redis setups measured side by side, one line per setup and concurrency (empty when
/// there are no rows).
pub fn side_by_side<'a>(title: &str, rows: impl Iterator<Item = (usize, [(&'a str, &'a Stats); 2])>) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    for (concurrency, pair) in rows {
        if s.is_empty() {
            let _ = writeln!(s, "\n{title}");
            let _ = writeln!(
                s,
                "{:>5} {:<10} {:>9} {:>8} {:>8} {:>8}",
                "conc", "redis", "writes/s", "p50 ms", "p99 ms", "p999 ms"
            );
        }
        for (name, st) in pair {
            let _ = writeln!(
                s,
                "{:>5} {:<10} {:>9.0} {:>8.3} {:>8.3} {:>8.3}",
                concurrency, name, st.per_sec, st.p50_ms, st.p99_ms, st.p999_ms
            );
        }
    }
    s
}
