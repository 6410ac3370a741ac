//! The benchmark's own load generator: a lean keep-alive HTTP client and a closed loop of
//! workers that each run one operation after another for a fixed time, timing every one.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use crate::http::{full, Body, BoxError};

/// How long one request may take before the benchmark counts it as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A keep-alive HTTP/1.1 client with no per-request work beyond hyper's own.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Body>,
}

/// A response as the benchmark needs it.
pub struct Reply {
    pub status: StatusCode,
    pub body: Bytes,
}

impl Http {
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(4096)
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Self { client }
    }

    pub async fn send(
        &self,
        method: Method,
        url: &str,
        body: Option<Bytes>,
        headers: &[(&str, &str)],
    ) -> Result<Reply, BoxError> {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let body = match body {
            Some(b) => {
                req = req.header("content-type", "application/json");
                full(b)
            }
            None => full(Bytes::new()),
        };
        let res = tokio::time::timeout(REQUEST_TIMEOUT, self.client.request(req.body(body)?)).await??;
        let (parts, body) = res.into_parts();
        let body = tokio::time::timeout(REQUEST_TIMEOUT, body.collect()).await??.to_bytes();
        Ok(Reply {
            status: parts.status,
            body,
        })
    }

    pub async fn get(&self, url: &str) -> Result<Reply, BoxError> {
        self.send(Method::GET, url, None, &[]).await
    }
}

impl Default for Http {
    fn default() -> Self {
        Self::new()
    }
}

/// Throughput and latency of one measured phase.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    /// Operations that succeeded inside the measured window.
    pub ok: u64,
    /// Operations that failed inside the measured window.
    pub failed: u64,
    pub secs: f64,
    /// Successful operations per second.
    pub per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl Stats {
    fn from(mut latencies: Vec<Duration>, failed: u64, window: Duration) -> Self {
        latencies.sort_unstable();
        let q = |q: f64| -> f64 {
            if latencies.is_empty() {
                return 0.0;
            }
            let i = ((latencies.len() as f64 - 1.0) * q).round() as usize;
            latencies[i].as_secs_f64() * 1000.0
        };
        let secs = window.as_secs_f64().max(1e-9);
        Self {
            ok: latencies.len() as u64,
            failed,
            secs,
            per_sec: latencies.len() as f64 / secs,
            p50_ms: q(0.50),
            p99_ms: q(0.99),
            p999_ms: q(0.999),
            max_ms: q(1.0),
        }
    }
}

/// The shape of one closed-loop phase.
#[derive(Clone, Copy, Debug)]
pub struct Phase {
    pub workers: usize,
    /// Unmeasured time first (connections opened, caches warm).
    pub warmup: Duration,
    pub measure: Duration,
    /// A hard cap on the operations of one worker, whatever the time.
    pub max_ops_per_worker: u64,
}

/// Runs `op(worker, seq, end)` back to back on `phase.workers` tasks; an operation returning
/// `true` succeeded, and should give up soon after `end`. Operations are counted by when they
/// finish: those finishing inside the measured window make its throughput and latencies;
/// those still running when it closes are not counted.
pub async fn closed_loop<F, Fut>(phase: Phase, op: F) -> Stats
where
    F: Fn(usize, u64, Instant) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let measure_from = start + phase.warmup;
    let end = measure_from + phase.measure;
    let mut tasks = Vec::with_capacity(phase.workers);
    for w in 0..phase.workers {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut failed = 0u64;
            let mut seq = 0u64;
            while seq < phase.max_ops_per_worker {
                let started = Instant::now();
                if started >= end {
                    break;
                }
                let ok = op(w, seq, end).await;
                seq += 1;
                let finished = Instant::now();
                if finished >= measure_from && finished < end {
                    if ok {
                        latencies.push(finished - started);
                    } else {
                        failed += 1;
                    }
                }
            }
            (latencies, failed)
        }));
    }
    let mut latencies = Vec::new();
    let mut failed = 0;
    for t in tasks {
        if let Ok((l, f)) = t.await {
            latencies.extend(l);
            failed += f;
        }
    }
    Stats::from(latencies, failed, phase.measure)
}

/// Runs rounds of `op(worker, round, end)`, one per worker at once, each round starting when
/// every operation of the previous one has finished: the fan-out pattern, where parallel tool
/// calls or sub-agents all write their results and the agent then moves on. Counted like
/// [`closed_loop`].
pub async fn bursts<F, Fut>(phase: Phase, op: F) -> Stats
where
    F: Fn(usize, u64, Instant) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send + 'static,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let measure_from = start + phase.warmup;
    let end = measure_from + phase.measure;
    let mut latencies = Vec::new();
    let mut failed = 0u64;
    let mut round = 0u64;
    while round < phase.max_ops_per_worker && Instant::now() < end {
        let tasks: Vec<_> = (0..phase.workers)
            .map(|w| {
                let fut = op(w, round, end);
                tokio::spawn(async move {
                    let started = Instant::now();
                    let ok = fut.await;
                    (ok, started, Instant::now())
                })
            })
            .collect();
        for t in tasks {
            let Ok((ok, started, finished)) = t.await else {
                continue;
            };
            if finished >= measure_from && finished < end {
                if ok {
                    latencies.push(finished - started);
                } else {
                    failed += 1;
                }
            }
        }
        round += 1;
    }
    Stats::from(latencies, failed, phase.measure)
}
