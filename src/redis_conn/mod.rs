//! One shared Redis connection that follows the server: reconnects after a restart or a
//! network cut, and re-resolves the primary through Sentinel after a failover.
//!
//! The URL forms are parsed in [`crate::redis_url`] (the check the injector makes too). Over
//! TLS (`rediss://`, `rediss+sentinel://`) each connection to the server is made with the
//! files of [`crate::redis_tls`], re-read when they change; a password file is re-read for
//! each new connection, so a rotated Secret is used without a restart.
//!
//! The module by concern: `single` (one server or the primary Sentinel names, plaintext or
//! TLS, pub/sub), `sentinel`, `cluster` (the cluster client, `WAIT` on a session's primary,
//! sharded pub/sub, the per-node health check), `progress` (the stall detector), `resend`,
//! `restart` (a restarted server noticed on each new connection).
//!
//! Why not redis-rs's `ConnectionManager`: it reconnects to one fixed address with one fixed
//! `ConnectionInfo`. This connection asks Sentinel which server is the primary at each
//! reconnection, opens TLS with files re-read when they change, reads a rotated password
//! file for each new connection, and tells the stall detector and the error counts what each
//! command met. A cluster uses redis-rs's cluster client, which reconnects to each node itself.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::{MultiplexedConnection, PubSub};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, RedisConnectionInfo, RedisError, TlsMode};
use tokio::sync::Mutex;

use crate::redis_tls::{ConnectError, Tls, TlsFiles};
use crate::redis_url::{ClusterSpec, SentinelSpec, Target};

mod cluster;
mod progress;
mod resend;

pub use self::resend::again_until;
mod restart;
mod scan;
mod sentinel;
mod single;

use self::cluster::build_cluster;
pub use self::cluster::{ClusterHealth, NodeHealth};
use self::progress::Progress;
use self::sentinel::build_sentinel;

/// How long one command may take before the connection is treated as broken.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_millis(500);

/// How often, at most, the TLS files are looked at for a change.
const RELOAD_CHECK_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("invalid Redis URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    /// A TLS or credentials setting that cannot be used (a file missing, a flag without TLS).
    #[error("{0}")]
    Setting(String),
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
}

/// How to connect, besides the URL: TLS files and credentials (`--redis-ca`, `--redis-cert`,
/// `--redis-key`, `--redis-tls-server-name`, `--redis-username`, `--redis-password-file`).
#[derive(Clone, Debug, Default)]
pub struct ConnOptions {
    pub tls: TlsFiles,
    /// The ACL user, over any user in the URL.
    pub username: Option<String>,
    /// A file holding the password (a mounted Secret), over any password in the URL.
    pub password_file: Option<PathBuf>,
}

/// Why a first connection failed, as a startup check tells it.
#[derive(Debug, thiserror::Error)]
pub enum StartupCheck {
    /// The TLS exchange failed: an untrusted certificate or one for another name, a client
    /// certificate Redis does not accept. Starting would not help.
    #[error("Redis at {url} refused the connection: {reason}")]
    Refused { url: String, reason: String },
    /// Redis did not answer (down, or not reachable yet) or refused the credentials; `/readyz`
    /// reports it until it answers.
    #[error("Redis at {url} not usable yet: {reason}")]
    Unreachable { url: String, reason: String },
}

#[derive(Clone)]
pub struct RedisConn {
    inner: Arc<Inner>,
}

struct Inner {
    source: Source,
    config: AsyncConnectionConfig,
    /// Bounds the TCP connect, the TLS handshake and the connection's own handshake.
    connect_timeout: Duration,
    response_timeout: Duration,
    tls: Option<Tls>,
    options: ConnOptions,
    /// When the TLS files were last looked at (microseconds on `progress`' clock).
    reload_checked_us: AtomicU64,
    /// The current connection: read on every command (a brief shared lock, never held across
    /// an await), replaced after a failure.
    current: std::sync::RwLock<Option<Conn>>,
    /// Serializes reconnecting, so a burst of failures opens one new connection.
    connecting: Mutex<()>,
    display: String,
    progress: Progress,
    /// Where failed commands are counted (by kind), once set.
    metrics: std::sync::OnceLock<crate::metrics::Metrics>,
    /// The server last connected to, and when it restarted (see `restart`).
    server: restart::ServerSeen,
}

enum Source {
    /// One server, plaintext.
    Direct(ConnectionInfo),
    /// One server over TLS.
    Tls {
        host: String,
        port: u16,
        info: RedisConnectionInfo,
    },
    Sentinel {
        client: Box<Mutex<SentinelClient>>,
        spec: SentinelSpec,
        tls: bool,
        /// The TLS files changed: the Sentinel client is rebuilt with them before its next use.
        stale: AtomicBool,
    },
    /// A Redis Cluster: commands are routed by their first key, and follow `MOVED`/`ASK`
    /// redirects and failovers within the client's bounded retries.
    Cluster {
        client: Box<ClusterClient>,
        spec: ClusterSpec,
        tls: bool,
    },
}

/// A connection commands are sent on: one server's, or a cluster's (each command routed to
/// the primary of its first key's slot).
#[derive(Clone)]
pub enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// A failed connection attempt: whether Redis refused us or could not be reached.
enum Failure {
    Refused(RedisError),
    Unreachable(RedisError),
}

impl Failure {
    fn into_error(self) -> RedisError {
        match self {
            Self::Refused(e) | Self::Unreachable(e) => e,
        }
    }

    /// Sorts an error from redis-rs: a failed certificate exchange is a refusal.
    fn of(e: RedisError) -> Self {
        if is_refusal(&e) {
            Self::Refused(e)
        } else {
            Self::Unreachable(e)
        }
    }
}

/// A TLS refusal: the certificate exchange failed. (A wrong password is not one: the proxy
/// starts and reports it, so a password rotated in Redis before its Secret does not stop
/// pods from starting.)
fn is_refusal(e: &RedisError) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    ["fatal alert", "certificate"].iter().any(|m| text.contains(m))
}

impl RedisConn {
    /// Parses the URL; no connection is made until the first command.
    pub fn open(url: &str, response_timeout: Duration) -> Result<Self, ConnError> {
        Self::open_with(url, response_timeout, &ConnOptions::default())
    }

    /// Parses the URL and loads the TLS files and credentials of `options`; no connection
    /// is made until the first command.
    pub fn open_with(url: &str, response_timeout: Duration, options: &ConnOptions) -> Result<Self, ConnError> {
        let target = crate::redis_url::parse(url).map_err(|e| ConnError::InvalidUrl {
            url: e.url,
            reason: e.reason,
        })?;
        let tls_flags = options.tls != TlsFiles::default();
        if tls_flags && !target.tls() {
            return Err(ConnError::Setting(
                "--redis-ca, --redis-cert, --redis-key and --redis-tls-server-name need a rediss://, rediss+sentinel:// or rediss+cluster:// URL"
                    .into(),
            ));
        }
        if let Some(path) = &options.password_file {
            read_password(path).map_err(ConnError::Setting)?;
        }
        let tls = if target.tls() {
            Some(Tls::load(options.tls.clone()).map_err(|e| ConnError::Setting(e.to_string()))?)
        } else {
            None
        };
        let source = match target {
            Target::Direct { info, tls: false } => Source::Direct(info),
            Target::Direct { info, tls: true } => match info.addr() {
                ConnectionAddr::TcpTls { host, port, .. } => Source::Tls {
                    host: host.clone(),
                    port: *port,
                    info: info.redis_settings().clone(),
                },
                _ => return Err(ConnError::Setting("rediss:// needs host:port".into())),
            },
            Target::Cluster { spec, tls: is_tls } => {
                if options.tls.server_name.is_some() {
                    return Err(ConnError::Setting(
                        "--redis-tls-server-name is not supported with rediss+cluster:// (each node is checked against the name it announces)".into(),
                    ));
                }
                let client = build_cluster(&spec, is_tls, options, tls.as_ref(), response_timeout, None)?;
                Source::Cluster {
                    client: Box::new(client),
                    spec,
                    tls: is_tls,
                }
            }
            Target::Sentinel { spec, tls: is_tls } => Source::Sentinel {
                client: Box::new(Mutex::new(build_sentinel(&spec, is_tls, options, tls.as_ref())?)),
                spec,
                tls: is_tls,
                stale: AtomicBool::new(false),
            },
        };
        let connect_timeout = response_timeout.max(Duration::from_millis(200));
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(response_timeout));
        Ok(Self {
            inner: Arc::new(Inner {
                source,
                config,
                connect_timeout,
                response_timeout,
                tls,
                options: options.clone(),
                reload_checked_us: AtomicU64::new(0),
                current: std::sync::RwLock::new(None),
                connecting: Mutex::new(()),
                display: crate::redis_url::redact(url),
                progress: Progress::new(),
                metrics: std::sync::OnceLock::new(),
                server: restart::ServerSeen::default(),
            }),
        })
    }

    /// The URL with any password removed, for logs.
    pub fn display(&self) -> &str {
        &self.inner.display
    }

    /// Counts this connection's failed commands in `metrics` (`redis_errors_total{kind}`).
    pub fn count_errors(&self, metrics: crate::metrics::Metrics) {
        let _ = self.inner.metrics.set(metrics);
    }

    /// How long Redis has gone without answering while commands waited for it (zero when
    /// nothing waits or the last command was answered just now).
    pub fn stalled_for(&self) -> Duration {
        self.inner.progress.stalled_for()
    }

    /// A connection to the current primary, connecting (or re-resolving it) when needed.
    pub async fn get(&self) -> Result<Conn, RedisError> {
        self.reload_if_due();
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _connecting = self.inner.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let conn = self.connect().await.map_err(Failure::into_error)?;
        self.learn_server(&conn).await;
        if let Ok(mut current) = self.inner.current.write() {
            *current = Some(conn.clone());
        }
        Ok(conn)
    }

    fn current(&self) -> Option<Conn> {
        self.inner.current.read().ok().and_then(|c| c.clone())
    }

    /// One first connection and a `PING`, to refuse a start that cannot work (an untrusted
    /// certificate, a client certificate refused) while a Redis that is only down, or refuses
    /// the password, lets the proxy start and report it.
    pub async fn check_at_startup(&self) -> Result<(), StartupCheck> {
        let url = self.display().to_owned();
        let bound = self.inner.connect_timeout * 3;
        let attempt = async {
            self.probe_tls().await?;
            let conn = self.connect().await?;
            let mut c = conn.clone();
            redis::cmd("PING")
                .query_async::<()>(&mut c)
                .await
                .map_err(Failure::of)?;
            self.learn_server(&conn).await;
            if let Ok(mut current) = self.inner.current.write() {
                *current = Some(conn);
            }
            Ok(())
        };
        match tokio::time::timeout(bound, attempt).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(Failure::Refused(e))) => Err(StartupCheck::Refused {
                url,
                reason: self.without_secrets(e.to_string()),
            }),
            Ok(Err(Failure::Unreachable(e))) => Err(StartupCheck::Unreachable {
                url,
                reason: self.without_secrets(e.to_string()),
            }),
            Err(_) => Err(StartupCheck::Unreachable {
                url,
                reason: format!("no answer within {bound:?}"),
            }),
        }
    }

    /// Whether connections use TLS (what a startup check can find wrong).
    pub fn uses_tls(&self) -> bool {
        self.inner.tls.is_some()
    }

    /// An error text with the password file's content replaced, should anything quote it.
    fn without_secrets(&self, text: String) -> String {
        match self
            .inner
            .options
            .password_file
            .as_ref()
            .and_then(|p| read_password(p).ok())
        {
            Some(pw) if !pw.is_empty() => text.replace(&pw, "***"),
            _ => text,
        }
    }

    /// Opens a new connection to the current primary.
    async fn connect(&self) -> Result<Conn, Failure> {
        if let Source::Cluster { client, .. } = &self.inner.source {
            let connecting = client.get_async_connection();
            return match tokio::time::timeout(self.inner.connect_timeout * 2, connecting).await {
                Ok(r) => r.map(Conn::Cluster).map_err(Failure::of),
                Err(_) => Err(Failure::Unreachable(io_error("no cluster node answered"))),
            };
        }
        self.connect_single().await.map(Conn::Single)
    }

    /// Looks at the TLS files at most once a second; when they changed, the next connection
    /// is made with the new ones (the current one is let go: commands in flight on it finish).
    fn reload_if_due(&self) {
        let Some(tls) = &self.inner.tls else { return };
        let now = self.inner.progress.now_us();
        let last = self.inner.reload_checked_us.load(Ordering::Acquire);
        if now.saturating_sub(last) < RELOAD_CHECK_EVERY.as_micros() as u64
            || self
                .inner
                .reload_checked_us
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return;
        }
        match tls.reload_if_changed() {
            Ok(false) => {}
            Ok(true) => {
                tracing::info!(
                    redis = self.display(),
                    "Redis TLS files changed: new connections use them"
                );
                if let Source::Sentinel { stale, .. } = &self.inner.source {
                    stale.store(true, Ordering::Release);
                }
                if let Ok(mut current) = self.inner.current.write() {
                    *current = None;
                }
            }
            Err(error) => {
                tracing::warn!(%error, "Redis TLS files changed but cannot be used: keeping the previous ones")
            }
        }
    }

    /// Forgets the current connection after an error, so the next command reconnects (and,
    /// with Sentinel, asks which server is the primary now).
    pub async fn reset(&self) {
        if self.is_cluster() {
            // The cluster client reconnects to each node and re-reads the slot layout itself.
            return;
        }
        if let Ok(mut current) = self.inner.current.write() {
            *current = None;
        }
    }

    /// Runs `f` on a connection; on an I/O-level failure the connection is dropped so the
    /// next call reconnects.
    pub async fn run<T, F, Fut>(&self, f: F) -> Result<T, RedisError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        let mut outstanding = self.inner.progress.begin();
        let result = match self.get().await {
            Ok(conn) => f(conn).await,
            Err(e) => Err(e),
        };
        outstanding.answered = Some(result.as_ref().map_or_else(|e| !needs_reconnect(e), |_| true));
        if let Err(e) = &result {
            if let Some(metrics) = self.inner.metrics.get() {
                metrics.redis_error(operation_of::<F>(), error_kind(e));
            }
            if needs_reconnect(e) {
                self.reset().await;
            }
        }
        result
    }
}

fn io_error(text: &str) -> RedisError {
    RedisError::from(std::io::Error::other(text.to_owned()))
}

/// The password in a file (a mounted Secret), without its trailing newline. The error names
/// the file, never its content.
fn read_password(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read --redis-password-file {}: {}", path.display(), e.kind()))?;
    let pw = text.trim_end_matches(['\n', '\r']).to_owned();
    if pw.is_empty() {
        return Err(format!("--redis-password-file {} is empty", path.display()));
    }
    Ok(pw)
}

// === impl Progress ===

impl Inner {
    fn config_response_timeout(&self) -> Duration {
        self.response_timeout
    }
}

/// The operation a command belongs to, for the `op` label: the name of the function whose
/// closure ran it (`try_acquire`, `renew`, `release`, `ping`, `get`, …); a bounded set, one
/// per call site.
fn operation_of<F>() -> &'static str {
    let name = std::any::type_name::<F>();
    let head = name.split("::{{closure}}").next().unwrap_or(name);
    head.rsplit("::").next().filter(|s| !s.is_empty()).unwrap_or("other")
}

/// The bounded `kind` label of a failed command.
fn error_kind(e: &RedisError) -> &'static str {
    if e.is_timeout() {
        "timeout"
    } else if e.is_connection_refusal() {
        "refused"
    } else if e.is_io_error() || e.is_connection_dropped() {
        "io"
    } else if e.to_string().contains("READONLY") {
        "readonly"
    } else if matches!(e.kind(), redis::ErrorKind::AuthenticationFailed) || e.to_string().contains("NOAUTH") {
        "auth"
    } else {
        "server"
    }
}

/// Whether an error means the connection (or the server's role) is gone, rather than a
/// problem with one command.
fn needs_reconnect(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(e.kind(), redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly))
        || e.to_string().contains("READONLY")
}

/// One key to write (a record stored with a lock's release, or on its own): key, value, and how long it lives. With `expect`, the record is
/// changed only while it still holds that value (compare-and-set); an empty `value` deletes it.
/// With `refresh`, only the lifetime of the record is set anew (when it exists), to `ttl`.
#[derive(Clone, Debug)]
pub struct Entry {
    pub key: String,
    pub value: Bytes,
    pub ttl: Duration,
    pub expect: Option<Bytes>,
    pub refresh: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        assert!(RedisConn::open("redis://127.0.0.1:6379", DEFAULT_RESPONSE_TIMEOUT).is_ok());
        assert!(RedisConn::open(
            "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/primary",
            DEFAULT_RESPONSE_TIMEOUT
        )
        .is_ok());
        assert!(RedisConn::open("redis+sentinel://127.0.0.1:26379", DEFAULT_RESPONSE_TIMEOUT).is_err());
        assert!(RedisConn::open("http://x", DEFAULT_RESPONSE_TIMEOUT).is_err());
    }

    #[test]
    fn tls_files_need_a_tls_url() {
        let options = ConnOptions {
            tls: TlsFiles {
                ca: Some("/nonexistent/ca.crt".into()),
                ..TlsFiles::default()
            },
            ..ConnOptions::default()
        };
        let e = RedisConn::open_with("redis://127.0.0.1:6379", DEFAULT_RESPONSE_TIMEOUT, &options)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("rediss://"), "{e}");
        let e = RedisConn::open_with("rediss://127.0.0.1:6379", DEFAULT_RESPONSE_TIMEOUT, &options)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("/nonexistent/ca.crt"), "{e}");
    }

    #[test]
    fn the_operation_of_a_command_is_the_function_that_ran_it() {
        fn try_acquire() -> &'static str {
            let f = |_: u8| ();
            name_of(&f)
        }
        fn name_of<F>(_: &F) -> &'static str {
            operation_of::<F>()
        }
        assert_eq!(try_acquire(), "try_acquire");
    }
}
