//! Assembling and running the sidecar: backends, pipeline, proxy and admin servers, and the
//! shutdown sequence (stop accepting, drain in-flight writes, release held locks).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admin;
use crate::config::{ConfigError, ProxyArgs, StartError};
use crate::health::Health;
use crate::lock::{LockSettings, Locks, MemoryLocks, RedisLocks};
use crate::metrics::Metrics;
use crate::proxy::{PipelineSettings, ProxyFactory};
use crate::records::Records;
use crate::redis_conn::ConnError;
use crate::redis_conn::RedisConn;
use crate::routes::Routes;
use crate::session::Keys;
use crate::transparent::Destinations;
use crate::upstream::PoolSettings;

/// A running sidecar: the agent-facing server, and what tests and the admin side look at.
pub struct Running {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub metrics: Metrics,
    pub locks: Locks,
    serving: crate::server::Serving,
    outcome: Arc<std::sync::Mutex<ShutdownOutcome>>,
}

impl Running {
    /// Shuts down gracefully (see [`start`]) and waits until it has.
    pub async fn stop(self) {
        self.serving.stop().await
    }

    pub fn shutdown_token(&self) -> CancellationToken {
        self.serving.shutdown_token()
    }

    /// Waits until the sidecar has stopped (after its shutdown token fired); says what the
    /// shutdown left undone.
    pub async fn wait(self) -> ShutdownOutcome {
        self.serving.wait().await;
        self.outcome.lock().map(|o| *o).unwrap_or_default()
    }
}

/// Builds everything from the configuration and starts serving.
/// What a proxy is made of, before any socket: its metrics, lock backend, per-store proxy
/// factory, the configured store and its proxy.
struct Assembled {
    metrics: Metrics,
    locks: Locks,
    factory: ProxyFactory,
    upstream: crate::upstream::Upstream,
    proxy: crate::proxy::Proxy,
    /// The Redis connection, when there is one (checked once at start).
    redis: Option<RedisConn>,
}

fn assemble(args: &ProxyArgs) -> Result<Assembled, StartError> {
    args.validate()?;
    let metrics = Metrics::new();
    let keys = Keys::new(args.key_prefix.clone());
    let settings = LockSettings::new(
        args.lease(),
        Duration::from_millis(args.upstream_timeout_ms),
        Duration::from_secs(args.session_ttl_secs),
    );
    let mut redis = None;
    let (locks, records) = match &args.redis {
        Some(url) => {
            let options = args.redis_options();
            let conn = RedisConn::open_with(url, Duration::from_millis(args.redis_timeout_ms), &options)
                .map_err(conn_error)?;
            conn.count_errors(metrics.clone());
            tracing::info!(redis = conn.display(), "locks, fences and idempotency records in Redis");
            let mut locks = RedisLocks::new(conn.clone(), keys.clone(), settings, metrics.clone());
            if args.redis_wait_replicas > 0 {
                let wait = Duration::from_millis(args.redis_wait_timeout_ms);
                let wait_conn =
                    RedisConn::open_with(url, Duration::from_millis(args.redis_timeout_ms) + wait, &options)
                        .map_err(conn_error)?;
                locks = locks.with_replica_wait(wait_conn, args.redis_wait_replicas, wait);
            }
            redis = Some(conn.clone());
            (Locks::Redis(locks.into()), Records::Redis(conn))
        }
        None => {
            tracing::warn!(
                "no --redis configured: the in-memory lock backend serializes only the writers inside this one process; \
                 replicas in other pods are NOT serialized against each other"
            );
            let locks = std::sync::Arc::new(MemoryLocks::new(settings, metrics.clone()));
            let records = Records::memory();
            spawn_sweeper(locks.clone(), records.clone());
            (Locks::Memory(locks), records)
        }
    };
    let routes = match &args.routes {
        Some(path) => Routes::from_file(path, &args.session_prefix).map_err(|e| ConfigError(e.to_string()))?,
        None => Routes::canonical(&args.session_prefix).map_err(ConfigError)?,
    };
    let snapshots = routes.has_merged_put();
    let factory = ProxyFactory {
        routes,
        locks: locks.clone(),
        records,
        keys,
        metrics: metrics.clone(),
        settings: PipelineSettings {
            budget: Duration::from_millis(args.lock_budget_ms),
            wait: Duration::from_millis(args.wait_deadline_ms),
            idempotency_ttl: Duration::from_secs(args.idempotency_ttl_secs),
            history_ttl: Duration::from_secs(args.history_ttl_secs),
            max_batch: args.max_batch,
            upstream_timeout: Duration::from_millis(args.upstream_timeout_ms),
            max_document_bytes: args.max_document_bytes,
            snapshots,
        },
        upstream_timeout: Duration::from_millis(args.upstream_timeout_ms),
        pool: PoolSettings {
            max_connections: args.upstream_max_connections,
            idle_timeout: Duration::from_millis(args.upstream_idle_timeout_ms),
        },
        max_body: crate::proxy::Limits {
            body: args.max_body_bytes,
            document: args.max_document_bytes,
        },
        upstream_ca: args.upstream_ca.clone(),
    };
    let upstream = factory.upstream(&args.upstream).map_err(ConfigError)?;
    let proxy = factory.proxy(upstream.clone());

    Ok(Assembled {
        metrics,
        locks,
        factory,
        upstream,
        proxy,
        redis,
    })
}

/// The proxy for the configured store with its layers, as a service with no socket (for
/// callers in the same process, and tests through `oneshot`). Needs a tokio runtime.
pub fn service<B>(args: &ProxyArgs) -> Result<crate::proxy::Stack<B>, StartError>
where
    B: http_body::Body<Data = bytes::Bytes> + Send + Sync + 'static,
    B::Error: Into<crate::http::BoxError>,
{
    let parts = assemble(args)?;
    Ok(crate::proxy::stack(parts.metrics, parts.proxy))
}

/// In transparent mode, ip6tables' REDIRECT sends an intercepted IPv6 connection to `[::1]`
/// (or the pod's own IPv6 address) on the proxy's port: an IPv4 `--listen` address gets a
/// second listener on its IPv6 counterpart (`127.0.0.1` → `[::1]`, `0.0.0.0` → `[::]`), on the
/// same port. `None` when `--listen` is IPv6 already or names another address, or when the
/// network namespace has no IPv6 (nothing can be redirected there then).
async fn bind_v6_counterpart(addr: SocketAddr) -> Result<Option<TcpListener>, StartError> {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(v4) if v4.is_loopback() => std::net::Ipv6Addr::LOCALHOST,
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::Ipv6Addr::UNSPECIFIED,
        _ => return Ok(None),
    };
    let v6 = SocketAddr::new(ip.into(), addr.port());
    let socket = match tokio::net::TcpSocket::new_v6() {
        Ok(s) => s,
        Err(error) => {
            tracing::info!(%error, "no IPv6 in this network namespace: intercepting IPv4 only");
            return Ok(None);
        }
    };
    let bound = socket2::SockRef::from(&socket)
        .set_only_v6(true)
        .and_then(|()| socket.set_reuseaddr(true))
        .and_then(|()| socket.bind(v6))
        .and_then(|()| socket.listen(1024));
    match bound {
        Ok(listener) => Ok(Some(listener)),
        Err(error)
            if !crate::transparent::namespace_has_ipv6() || error.kind() == std::io::ErrorKind::AddrNotAvailable =>
        {
            tracing::info!(%error, addr = %v6, "no IPv6 listener: intercepting IPv4 only");
            Ok(None)
        }
        Err(error) => Err(StartError::bind(v6, error)),
    }
}

pub async fn start(args: ProxyArgs) -> Result<Running, StartError> {
    let Assembled {
        metrics,
        locks,
        factory,
        upstream,
        proxy,
        redis,
    } = assemble(&args)?;
    if let Some(conn) = &redis {
        check_redis(conn).await?;
        check_key_layout(conn, &args.key_prefix).await?;
    }
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| StartError::bind(args.listen, e))?;
    let admin_listener = TcpListener::bind(args.admin).await.map_err(|source| StartError::Bind {
        what: "admin address ",
        addr: args.admin,
        source,
    })?;
    let addr = listener.local_addr().map_err(|e| ConfigError(e.to_string()))?;
    let listener_v6 = if args.transparent {
        bind_v6_counterpart(addr).await?
    } else {
        None
    };
    let admin_addr = admin_listener.local_addr().map_err(|e| ConfigError(e.to_string()))?;

    let shutdown = CancellationToken::new();
    let grace = Duration::from_millis(args.shutdown_grace_ms);
    // In transparent mode each connection names its own store: readiness asks only Redis.
    let health = Health::new(!args.transparent, shutdown.clone());
    let destinations = Destinations::new(factory, proxy, addr);
    let transparent = args.transparent;
    let admin_stop = CancellationToken::new();
    health.spawn_checks(
        locks.clone(),
        (!args.transparent).then_some(upstream),
        metrics.clone(),
        admin_stop.clone(),
    );
    let admin_task = tokio::spawn(admin::serve(
        admin_listener,
        metrics.clone(),
        health,
        args.admin_public_metrics,
        admin_stop.clone(),
    ));

    let outcome = Arc::new(std::sync::Mutex::new(ShutdownOutcome::default()));
    let task = {
        let metrics = metrics.clone();
        let shutdown = shutdown.clone();
        let locks = locks.clone();
        let outcome = outcome.clone();
        tokio::spawn(async move {
            let make = || {
                let destinations = destinations.clone();
                let metrics = metrics.clone();
                move |conn| crate::proxy::Edge::new(metrics.clone(), destinations.for_connection(conn))
            };
            // Requests the HTTP parser answered itself are counted as any other answer.
            let unparsed: crate::server::OnUnparsed = {
                let metrics = metrics.clone();
                Arc::new(move |status, code| metrics.request("unparsed", status, code))
            };
            let serving = crate::server::serve_with(
                listener,
                make(),
                transparent,
                Some(unparsed.clone()),
                shutdown.clone(),
                grace,
            );
            // Transparent mode: IPv6 connections redirected by the ip6tables rules arrive here.
            let serving_v6 = async {
                if let Some(l) = listener_v6 {
                    crate::server::serve_with(l, make(), transparent, Some(unparsed.clone()), shutdown.clone(), grace)
                        .await
                }
            };
            let began = async {
                shutdown.cancelled().await;
                (Instant::now(), locks.release_failures())
            };
            let ((), (), (began, failures_before)) = tokio::join!(serving, serving_v6, began);
            let result = finish_shutdown(&destinations, &locks, began + grace, failures_before).await;
            if let Ok(mut o) = outcome.lock() {
                *o = result;
            }
            admin_stop.cancel();
            // The admin server's own drain must not stretch the total past the grace.
            let _ = tokio::time::timeout(ADMIN_STOP, admin_task).await;
            tracing::info!(
                abandoned_writes = result.abandoned_writes,
                locks_left = result.locks_left,
                took_ms = began.elapsed().as_millis() as u64,
                "stopped"
            );
        })
    };
    tracing::info!(%addr, admin = %admin_addr, upstream = %args.upstream, transparent, "turnlock proxy listening");
    Ok(Running {
        addr,
        admin: admin_addr,
        metrics,
        locks,
        serving: crate::server::Serving::new(addr, shutdown, task),
        outcome,
    })
}

/// Over TLS, one first connection: a failed certificate exchange (an untrusted certificate,
/// a client certificate refused) stops the start with the reason; a Redis that is down or
/// refuses the password lets the proxy start, with the reason in `/readyz`.
async fn check_redis(conn: &RedisConn) -> Result<(), StartError> {
    if !conn.uses_tls() {
        return Ok(());
    }
    match conn.check_at_startup().await {
        Ok(()) => Ok(()),
        Err(e @ crate::redis_conn::StartupCheck::Refused { .. }) => Err(StartError::Backend(e.to_string())),
        Err(error) => {
            tracing::warn!(%error, "starting: /readyz reports Redis until it answers");
            Ok(())
        }
    }
}

/// Refuses to start beside keys of the older key layout (see [`crate::key_layout`]); a Redis
/// that does not answer within a few seconds is left to `/status` to report.
async fn check_key_layout(conn: &RedisConn, prefix: &str) -> Result<(), StartError> {
    let check = crate::key_layout::check(conn, prefix, conn.display());
    match tokio::time::timeout(KEY_LAYOUT_CHECK, check).await {
        Ok(result) => result.map_err(StartError::Backend),
        Err(_) => {
            tracing::warn!("no answer while looking for keys of the older key layout: not checked");
            Ok(())
        }
    }
}

/// How long the startup check for old-layout keys may take.
const KEY_LAYOUT_CHECK: Duration = Duration::from_secs(5);

/// A Redis URL that does not parse is bad configuration; any other failure to set the
/// connection up is the backend's.
fn conn_error(e: ConnError) -> StartError {
    match e {
        ConnError::InvalidUrl { .. } | ConnError::Setting(_) => StartError::Config(ConfigError(e.to_string())),
        ConnError::Redis(_) => StartError::Backend(e.to_string()),
    }
}

/// How long the shutdown may spend giving back locks after the grace, when writes ran to it.
const RELEASE_FLOOR: Duration = Duration::from_millis(300);
/// How long the admin server gets to close once everything else has stopped.
const ADMIN_STOP: Duration = Duration::from_millis(100);

/// What a shutdown left undone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShutdownOutcome {
    /// Writes still running when the grace ran out (their agents got no answer).
    pub abandoned_writes: bool,
    /// Locks not given back (they expire after their lease).
    pub locks_left: usize,
}

impl ShutdownOutcome {
    pub fn clean(&self) -> bool {
        !self.abandoned_writes && self.locks_left == 0
    }
}

/// Drains in-flight writes until `deadline`, then gives back the locks still held, within
/// what is left of the grace (at least [`RELEASE_FLOOR`]).
async fn finish_shutdown(
    destinations: &Destinations,
    locks: &Locks,
    deadline: Instant,
    failures_before: usize,
) -> ShutdownOutcome {
    let abandoned_writes = tokio::time::timeout_at(deadline.into(), destinations.drain())
        .await
        .is_err();
    if abandoned_writes {
        tracing::warn!("writes still in flight when the grace period ran out: abandoned");
    }
    let budget = deadline.saturating_duration_since(Instant::now()).max(RELEASE_FLOOR);
    match tokio::time::timeout(budget, locks.release_all()).await {
        Ok(released) if released > 0 => tracing::info!(released, "released locks still held at shutdown"),
        Ok(_) => {}
        Err(_) => tracing::warn!(
            left = locks.held_count(),
            "could not release every lock in time: the rest expire after their lease"
        ),
    }
    // Locks whose release failed since the shutdown began are left to expire too.
    let failed = locks.release_failures().saturating_sub(failures_before);
    ShutdownOutcome {
        abandoned_writes,
        locks_left: locks.held_count() + failed,
    }
}

fn spawn_sweeper(locks: std::sync::Arc<MemoryLocks>, records: Records) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(crate::lock::memory_sweep_every());
        loop {
            tick.tick().await;
            locks.sweep();
            records.sweep();
        }
    });
}
