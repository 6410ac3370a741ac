//! The measured phases, run against one set of processes (the rig).

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::baselines::{self, PollingLock, Waiting};
use super::compaction::{self, Target};
use super::histograms::Histograms;
use super::load::{bursts, closed_loop, Http, Phase};
use super::procs::{self, Child};
use super::{BenchError, HotRow, PassRow, Plan, Resources, WriteRow};
use crate::redis_conn::RedisConn;

pub const TURNLOCK: &str = "turnlock";
pub const NAIVE: &str = "naive lock";
pub const BACKOFF: &str = "backoff lock";
/// Every writer writes again as soon as its write is answered.
pub const STEADY: &str = "steady";
/// Rounds: every writer writes once, the next round starts when all are answered.
pub const BURSTS: &str = "bursts";
/// The hot session's document grows by every write.
pub const GROWING: &str = "growing";
/// The hot session's document is compacted periodically, as agents do: it stays near
/// [`compaction::KEEP`] messages.
pub const COMPACTED: &str = "compacted";

/// Sessions each writer of the uncontended phase cycles through.
const SESSIONS_PER_WRITER: u64 = 8;
/// Messages in the document the pass-through phase reads.
const READ_DOC_MESSAGES: usize = 20;
/// Hard cap on one worker's operations in a phase, whatever its duration.
const MAX_OPS_PER_WORKER: u64 = 1_000_000;
/// Rounds of `wrk` through the proxies and through nginx, in turn (see `wrk::alternate`).
const PASS_ROUNDS: usize = 3;

/// A `wrk` run's figures, its failure logged.
fn ok_or_warn(run: Result<super::wrk::WrkRun, String>) -> Option<super::wrk::WrkRun> {
    run.map_err(|error| tracing::warn!(%error, "wrk run failed")).ok()
}
/// Most attempts one hot-session write makes (busy answers are retried).
const MAX_ATTEMPTS: u32 = 1_000;

/// Redis, the store and the proxies, killed when dropped (proxies first: fields drop in
/// order).
pub struct Rig {
    exe: std::path::PathBuf,
    proxies: Vec<Child>,
    store: Child,
    /// Stopped last.
    redis: Child,
    http: Http,
    redis_conn: RedisConn,
}

impl Rig {
    pub async fn start(exe: &Path, redis_server: &str, proxies: usize) -> Result<Self, BenchError> {
        let redis = procs::redis(redis_server).await?;
        let store = procs::store(exe).await?;
        let mut started = Vec::with_capacity(proxies);
        for n in 0..proxies {
            started.push(procs::proxy(exe, n, store.addr, redis.addr, None).await?);
        }
        let redis_conn = RedisConn::open(&format!("redis://{}", redis.addr), Duration::from_secs(2))
            .map_err(|e| BenchError::Start(e.to_string()))?;
        Ok(Self {
            exe: exe.to_path_buf(),
            redis,
            store,
            proxies: started,
            http: Http::new(),
            redis_conn,
        })
    }

    fn store_url(&self) -> String {
        format!("http://{}", self.store.addr)
    }

    fn proxy_url(&self, n: usize) -> String {
        format!("http://{}", self.proxies[n % self.proxies.len()].addr)
    }

    /// The first proxy's memory idle, and with `connections` open keep-alive connections
    /// that each made one request, a second after the last one (the connections idle, the
    /// memory their requests used handed back).
    pub async fn resources(&self, connections: usize) -> Result<Resources, BenchError> {
        let proxy = &self.proxies[0];
        let mib = |b: Option<u64>| b.map(|b| b as f64 / (1024.0 * 1024.0)).unwrap_or(f64::NAN);
        let idle = mib(proxy.rss_bytes());
        let mut open = Vec::with_capacity(connections);
        for chunk in (0..connections).collect::<Vec<_>>().chunks(100) {
            let opened = futures_util::future::join_all(chunk.iter().map(|_| open_connection(proxy.addr))).await;
            for c in opened {
                open.push(c?);
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let busy = mib(proxy.rss_bytes());
        let n = open.len();
        drop(open);
        Ok(Resources {
            rss_idle_mib: idle,
            open_connections: n,
            rss_open_connections_mib: busy,
        })
    }

    pub async fn passthrough(&self, plan: &Plan, wrk: &str, nginx: &str) -> Result<Vec<PassRow>, BenchError> {
        let path = "/v1/sessions/read-0";
        let messages: Vec<Value> = (0..READ_DOC_MESSAGES)
            .map(|i| baselines::message(&format!("m-{i}")))
            .collect();
        let doc = json!({"session": "read-0", "turn": 1, "version": 0, "messages": messages, "state": {}});
        let seeded = self
            .http
            .send(
                Method::PUT,
                &format!("{}{path}", self.store_url()),
                Some(Bytes::from(doc.to_string())),
                &[],
            )
            .await;
        if !matches!(&seeded, Ok(r) if r.status.is_success()) {
            return Err(BenchError::Failed(
                "cannot seed the document read in the pass-through phase".into(),
            ));
        }
        let nginx = match procs::nginx_program(nginx) {
            Some(program) => Some(procs::nginx(&program, self.store.addr).await?),
            None => {
                tracing::warn!(
                    "nginx not found: no nginx pass-through figures (install it with `apt-get install -y nginx-light`)"
                );
                None
            }
        };
        let wrk_installed = procs::installed(wrk, "--version");
        if !wrk_installed {
            tracing::warn!("{wrk} not found: pass-through figures from the benchmark's own client only");
        }
        // A proxy on one worker thread beside the default one: nginx runs one worker.
        let one_thread = procs::proxy(&self.exe, self.proxies.len(), self.store.addr, self.redis.addr, Some(1)).await?;
        let one_thread_url = format!("http://{}{path}", one_thread.addr);
        // The reference: hyper with no work on the request, when built.
        let floor = if wrk_installed {
            procs::hyper_floor(&self.exe, self.store.addr).await
        } else {
            None
        };
        let floor_url = floor.as_ref().map(|f| format!("http://{}{path}", f.addr));
        let mut rows = Vec::new();
        for &c in &plan.pass_levels {
            let direct_url = format!("{}{path}", self.store_url());
            let proxy_url = format!("{}{path}", self.proxy_url(0));
            let nginx_url = nginx.as_ref().map(|n| format!("http://{}{path}", n.addr));
            let direct = get_loop(plan, c, &direct_url).await;
            let proxy = get_loop(plan, c, &proxy_url).await;
            let nginx_stats = match &nginx_url {
                Some(url) => Some(get_loop(plan, c, url).await),
                None => None,
            };
            let (mut wrk_direct, mut wrk_proxy, mut wrk_one_thread, mut wrk_nginx, mut wrk_floor) =
                (None, None, None, None, None);
            if wrk_installed {
                let store_cpu = || self.store.cpu_time();
                wrk_direct = ok_or_warn(super::wrk::run(wrk, &direct_url, c, plan.measure, Some(&store_cpu)).await);
                let proxy_cpu = || self.proxies[0].cpu_time();
                let one_thread_cpu = || one_thread.cpu_time();
                let nginx_cpu = || nginx.as_ref().and_then(procs::Child::tree_cpu_time);
                let floor_cpu = || floor.as_ref().and_then(procs::Child::cpu_time);
                let urls: Vec<(&str, Option<super::wrk::CpuClock<'_>>)> = [
                    Some((proxy_url.as_str(), Some(&proxy_cpu as super::wrk::CpuClock<'_>))),
                    Some((one_thread_url.as_str(), Some(&one_thread_cpu))),
                    nginx_url
                        .as_deref()
                        .map(|url| (url, Some(&nginx_cpu as super::wrk::CpuClock<'_>))),
                    floor_url
                        .as_deref()
                        .map(|url| (url, Some(&floor_cpu as super::wrk::CpuClock<'_>))),
                ]
                .into_iter()
                .flatten()
                .collect();
                let mut runs = super::wrk::alternate(wrk, &urls, c, plan.measure, PASS_ROUNDS)
                    .await
                    .into_iter();
                wrk_proxy = runs.next().and_then(ok_or_warn);
                wrk_one_thread = runs.next().and_then(ok_or_warn);
                if nginx_url.is_some() {
                    wrk_nginx = runs.next().and_then(ok_or_warn);
                }
                if floor_url.is_some() {
                    wrk_floor = runs.next().and_then(ok_or_warn);
                }
            }
            rows.push(PassRow {
                concurrency: c,
                direct,
                proxy,
                nginx: nginx_stats,
                wrk_direct,
                wrk_proxy,
                wrk_proxy_one_thread: wrk_one_thread,
                wrk_nginx,
                wrk_floor,
            });
        }
        Ok(rows)
    }

    pub async fn uncontended(&self, plan: &Plan) -> Result<Vec<WriteRow>, BenchError> {
        let mut rows = Vec::new();
        for &c in &plan.write_levels {
            let phase = Phase {
                workers: c,
                warmup: plan.warmup,
                measure: plan.measure,
                max_ops_per_worker: MAX_OPS_PER_WORKER,
            };
            let (http, store) = (self.http.clone(), self.store_url());
            let direct = closed_loop(phase, move |w, seq, _end| {
                let (http, store) = (http.clone(), store.clone());
                async move {
                    let session = format!("u-direct-{c}-{w}-{}", seq % SESSIONS_PER_WRITER);
                    let msg = baselines::message(&format!("w{w}-{seq}"));
                    baselines::get_modify_put(&http, &store, &session, 1, &msg).await
                }
            })
            .await;

            let cpu_before = self.proxies[0].cpu_time();
            let total = Arc::new(AtomicU64::new(0));
            let (http, proxy, counted) = (self.http.clone(), self.proxy_url(0), total.clone());
            let through = closed_loop(phase, move |w, seq, _end| {
                let (http, proxy, counted) = (http.clone(), proxy.clone(), counted.clone());
                async move {
                    let session = format!("u-proxy-{c}-{w}-{}", seq % SESSIONS_PER_WRITER);
                    let ok = append(&http, &proxy, &session, &format!("w{w}-{seq}")).await == Some(true);
                    counted.fetch_add(1, Ordering::Relaxed);
                    ok
                }
            })
            .await;
            let cpu_after = self.proxies[0].cpu_time();
            let writes = total.load(Ordering::Relaxed).max(1) as f64;
            let (redis_commands_per_write, redis_bytes_per_write) = self.redis_cost_per_write(c).await?;
            rows.push(WriteRow {
                concurrency: c,
                direct,
                proxy: through,
                redis_commands_per_write,
                proxy_cpu_ms_per_1000: cpu_ms_per_1000(cpu_before, cpu_after, writes),
                redis_bytes_per_write,
            });
        }
        Ok(rows)
    }

    pub async fn hot(&self, plan: &Plan) -> Result<Vec<HotRow>, BenchError> {
        let mut rows = Vec::new();
        for doc in [GROWING, COMPACTED] {
            for &writers in &plan.hot_levels {
                for load in [STEADY, BURSTS] {
                    for design in [TURNLOCK, BACKOFF, NAIVE] {
                        rows.push(self.hot_one(plan, writers, design, load, doc).await?);
                    }
                }
            }
        }
        Ok(rows)
    }

    async fn hot_one(
        &self,
        plan: &Plan,
        writers: usize,
        design: &'static str,
        load: &'static str,
        doc: &'static str,
    ) -> Result<HotRow, BenchError> {
        let session = format!("hot-{}-{load}-{writers}-{doc}", design.replace(' ', "-"));
        let stop = Arc::new(AtomicBool::new(false));
        let compactor = (doc == COMPACTED).then(|| {
            let polling = PollingLock::new(
                self.redis_conn.clone(),
                Waiting::Backoff {
                    first: baselines::BACKOFF_FIRST,
                    max: baselines::BACKOFF_MAX,
                },
            );
            let target = if design == TURNLOCK {
                Target::Proxy(self.proxy_url(0))
            } else {
                Target::Store(self.store_url(), polling)
            };
            compaction::spawn(self.http.clone(), target, &session, stop.clone())
        });
        let phase = Phase {
            workers: writers,
            warmup: plan.warmup,
            measure: plan.measure,
            max_ops_per_worker: MAX_OPS_PER_WORKER,
        };
        let acked: Arc<Mutex<Vec<String>>> = Arc::default();
        let busy = Arc::new(AtomicU64::new(0));
        let before = self.histograms().await;
        let cpu_before = self.proxies_cpu();
        let stats = if design == TURNLOCK {
            let proxies: Vec<String> = (0..self.proxies.len()).map(|n| self.proxy_url(n)).collect();
            let (http, acked, busy, session) = (self.http.clone(), acked.clone(), busy.clone(), session.clone());
            drive(load, phase, move |w, seq, end| {
                let proxy = proxies[w % proxies.len()].clone();
                let (http, acked, busy, session) = (http.clone(), acked.clone(), busy.clone(), session.clone());
                async move {
                    let id = format!("w{w}-{seq}");
                    for _ in 0..MAX_ATTEMPTS {
                        match append(&http, &proxy, &session, &id).await {
                            Some(true) => {
                                lock(&acked).push(id);
                                return true;
                            }
                            Some(false) if Instant::now() < end => {
                                busy.fetch_add(1, Ordering::Relaxed);
                                // Retry soon: a short jittered pause, as a client would.
                                let pause = rand::random::<u64>() % 2_000;
                                tokio::time::sleep(Duration::from_micros(pause)).await;
                            }
                            _ => return false,
                        }
                    }
                    false
                }
            })
            .await
        } else {
            let waiting = if design == NAIVE {
                Waiting::Fixed(baselines::NAIVE_SLEEP)
            } else {
                Waiting::Backoff {
                    first: baselines::BACKOFF_FIRST,
                    max: baselines::BACKOFF_MAX,
                }
            };
            let lock_key = format!("bench:lock:{session}");
            let polling = PollingLock::new(self.redis_conn.clone(), waiting);
            let (http, store, acked, session) = (self.http.clone(), self.store_url(), acked.clone(), session.clone());
            drive(load, phase, move |w, seq, end| {
                let (http, store, acked, session, polling, lock_key) = (
                    http.clone(),
                    store.clone(),
                    acked.clone(),
                    session.clone(),
                    polling.clone(),
                    lock_key.clone(),
                );
                async move {
                    let id = format!("w{w}-{seq}");
                    let token = format!("{:032x}", rand::random::<u128>());
                    if !polling.acquire(&lock_key, &token, end).await {
                        return false;
                    }
                    let ok = baselines::get_modify_put(&http, &store, &session, 1, &baselines::message(&id)).await;
                    polling.release(&lock_key, &token).await;
                    if ok {
                        lock(&acked).push(id);
                    }
                    ok
                }
            })
            .await
        };
        let cpu_after = self.proxies_cpu();
        let after = self.histograms().await;
        stop.store(true, Ordering::Relaxed);
        let compacted = match compactor {
            Some(c) => c.await.unwrap_or_default(),
            None => Vec::new(),
        };
        let acked = std::mem::take(&mut *lock(&acked));
        let (lost, duplicated) = self.verify(&session, &acked, &compacted).await?;
        let turnlock = design == TURNLOCK;
        let explained = match (before, after) {
            (Some(b), Some(a)) if turnlock => Some(a.since(&b)),
            _ => None,
        };
        Ok(HotRow {
            writers,
            design: design.to_owned(),
            load: load.to_owned(),
            doc: doc.to_owned(),
            stats,
            busy: busy.load(Ordering::Relaxed),
            acked_total: acked.len() as u64,
            lost,
            duplicated,
            mean_batch: explained.as_ref().and_then(|h| h.batch.mean()),
            mean_lock_wait_ms: explained.as_ref().and_then(|h| h.wait.mean()).map(|s| s * 1000.0),
            mean_lock_hold_ms: explained.as_ref().and_then(|h| h.hold.mean()).map(|s| s * 1000.0),
            mean_store_get_ms: explained.as_ref().and_then(|h| h.get.mean()).map(|s| s * 1000.0),
            mean_store_put_ms: explained.as_ref().and_then(|h| h.put.mean()).map(|s| s * 1000.0),
            cpu_ms_per_1000: turnlock.then(|| cpu_ms_per_1000(cpu_before, cpu_after, acked.len().max(1) as f64)),
        })
    }

    /// Acknowledged messages missing from the stored document (and not compacted away),
    /// and messages stored twice.
    async fn verify(&self, session: &str, acked: &[String], compacted: &[String]) -> Result<(u64, u64), BenchError> {
        let url = format!("{}/v1/sessions/{session}", self.store_url());
        let stored: Vec<String> = match self.http.get(&url).await {
            Ok(r) if r.status == StatusCode::OK => serde_json::from_slice::<Value>(&r.body)
                .ok()
                .and_then(|d| {
                    d["messages"]
                        .as_array()
                        .map(|m| m.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect())
                })
                .unwrap_or_default(),
            Ok(r) if r.status == StatusCode::NOT_FOUND => Vec::new(),
            _ => return Err(BenchError::Failed(format!("cannot read back {session} from the store"))),
        };
        let unique: HashSet<&String> = stored.iter().collect();
        let twice = (stored.len() - unique.len()) as u64;
        let mut kept = unique;
        kept.extend(compacted);
        let lost = acked.iter().filter(|id| !kept.contains(id)).count() as u64;
        Ok((lost, twice))
    }

    /// Commands the proxy sends to Redis per uncontended append, counted with `MONITOR`
    /// (commands that scripts run inside Redis are not counted: they cost no round trip), and
    /// the growth of Redis's memory per append.
    async fn redis_cost_per_write(&self, tag: usize) -> Result<(f64, f64), BenchError> {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        const SESSIONS: usize = 8;
        const WRITES: usize = 200;
        let proxy = self.proxy_url(0);
        // The sessions exist first: a session's first write also creates it.
        for s in 0..SESSIONS {
            append(&self.http, &proxy, &format!("rt-{tag}-{s}"), "created").await;
        }
        let fail = |e: std::io::Error| BenchError::Failed(format!("redis MONITOR: {e}"));
        let mut monitor = tokio::net::TcpStream::connect(self.redis.addr).await.map_err(fail)?;
        monitor.write_all(b"MONITOR\r\n").await.map_err(fail)?;
        let mut lines = BufReader::new(monitor).lines();
        let ok = lines.next_line().await.map_err(fail)?;
        if ok.as_deref() != Some("+OK") {
            return Err(BenchError::Failed(format!("redis MONITOR answered {ok:?}")));
        }
        let memory_before = used_memory(self.redis.addr).await?;
        let counter = tokio::spawn(async move {
            let mut n = 0u64;
            while let Ok(Ok(Some(line))) = tokio::time::timeout(Duration::from_millis(300), lines.next_line()).await {
                if !line.contains(" lua]") {
                    n += 1;
                }
            }
            n
        });
        for i in 0..WRITES {
            append(
                &self.http,
                &proxy,
                &format!("rt-{tag}-{}", i % SESSIONS),
                &format!("rt{i}"),
            )
            .await;
        }
        let memory_after = used_memory(self.redis.addr).await?;
        let commands = counter.await.map_err(|e| BenchError::Failed(e.to_string()))?;
        Ok((
            commands as f64 / WRITES as f64,
            memory_after.saturating_sub(memory_before) as f64 / WRITES as f64,
        ))
    }

    /// The proxies' histograms that explain a hot-session run, summed over all proxies.
    async fn histograms(&self) -> Option<Histograms> {
        let mut h = Histograms::default();
        for p in &self.proxies {
            let admin = p.admin?;
            let text = self.http.get(&format!("http://{admin}/metrics")).await.ok()?.body;
            let text = String::from_utf8_lossy(&text);
            let value = |name: &str| -> f64 {
                text.lines()
                    .filter_map(|l| l.strip_prefix(name))
                    .filter_map(|rest| rest.rsplit(' ').next().and_then(|v| v.trim().parse::<f64>().ok()))
                    .sum()
            };
            h.batch.add(
                value("turnlock_write_batch_size_sum"),
                value("turnlock_write_batch_size_count"),
            );
            h.hold.add(
                value("turnlock_lock_hold_seconds_sum"),
                value("turnlock_lock_hold_seconds_count"),
            );
            h.wait.add(
                value("turnlock_lock_wait_seconds_sum"),
                value("turnlock_lock_wait_seconds_count"),
            );
            h.get.add(
                value("turnlock_upstream_request_seconds_sum{op=\"get\"}"),
                value("turnlock_upstream_request_seconds_count{op=\"get\"}"),
            );
            h.put.add(
                value("turnlock_upstream_request_seconds_sum{op=\"put\"}"),
                value("turnlock_upstream_request_seconds_count{op=\"put\"}"),
            );
        }
        Some(h)
    }

    fn proxies_cpu(&self) -> Option<Duration> {
        self.proxies.iter().map(Child::cpu_time).sum()
    }
}

/// Runs `op` in the way `load` names.
async fn drive<F, Fut>(load: &str, phase: Phase, op: F) -> super::Stats
where
    F: Fn(usize, u64, Instant) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    if load == BURSTS {
        bursts(phase, op).await
    } else {
        closed_loop(phase, op).await
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn cpu_ms_per_1000(before: Option<Duration>, after: Option<Duration>, writes: f64) -> f64 {
    match (before, after) {
        (Some(b), Some(a)) => a.saturating_sub(b).as_secs_f64() * 1000.0 / writes * 1000.0,
        _ => f64::NAN,
    }
}

/// One append through turnlock: `Some(true)` acknowledged, `Some(false)` refused as
/// retryable (busy), `None` any other failure.
async fn append(http: &Http, proxy: &str, session: &str, id: &str) -> Option<bool> {
    let body = json!({"turn": 1, "messages": [baselines::message(id)]});
    let url = format!("{proxy}/v1/sessions/{session}/messages");
    match http
        .send(Method::POST, &url, Some(Bytes::from(body.to_string())), &[])
        .await
    {
        Ok(r) if r.status.is_success() => Some(true),
        Ok(r) if r.status == StatusCode::SERVICE_UNAVAILABLE => Some(false),
        _ => None,
    }
}

async fn get_loop(plan: &Plan, concurrency: usize, url: &str) -> super::Stats {
    let phase = Phase {
        workers: concurrency,
        warmup: plan.warmup,
        measure: plan.measure,
        max_ops_per_worker: MAX_OPS_PER_WORKER,
    };
    let http = Http::new();
    let url = url.to_owned();
    closed_loop(phase, move |_w, _seq, _end| {
        let (http, url) = (http.clone(), url.clone());
        async move { matches!(http.get(&url).await, Ok(r) if r.status == StatusCode::OK) }
    })
    .await
}

/// Opens one keep-alive connection and makes one request on it; the connection stays open
/// while the returned sender lives.
async fn open_connection(
    addr: std::net::SocketAddr,
) -> Result<hyper::client::conn::http1::SendRequest<crate::http::Body>, BenchError> {
    let fail = |e: &dyn std::fmt::Display| BenchError::Failed(format!("connection to the proxy: {e}"));
    let stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| fail(&e))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| fail(&e))?;
    tokio::spawn(conn);
    let req = http::Request::get("/v1/sessions/read-0")
        .header(http::header::HOST, addr.to_string())
        .body(crate::http::empty())
        .map_err(|e| fail(&e))?;
    let res = sender.send_request(req).await.map_err(|e| fail(&e))?;
    let _ = res.into_body().collect().await;
    Ok(sender)
}

/// Redis's `used_memory`, from `INFO memory`.
async fn used_memory(addr: std::net::SocketAddr) -> Result<u64, BenchError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fail = |e: std::io::Error| BenchError::Failed(format!("redis INFO: {e}"));
    let mut conn = tokio::net::TcpStream::connect(addr).await.map_err(fail)?;
    conn.write_all(b"INFO memory\r\nQUIT\r\n").await.map_err(fail)?;
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(5), conn.read_to_string(&mut reply))
        .await
        .map_err(|_| BenchError::Failed("redis INFO: no answer".into()))?
        .map_err(fail)?;
    reply
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| BenchError::Failed("redis INFO: no used_memory".into()))
}
