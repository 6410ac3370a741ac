//! One shared Redis connection that follows the server: reconnects after a restart or a
//! network cut, and re-resolves the primary through Sentinel after a failover.
//!
//! The URL forms are parsed in [`crate::redis_url`] (the check the injector makes too). Over
//! TLS (`rediss://`, `rediss+sentinel://`) each connection to the server is made with the
//! files of [`crate::redis_tls`], re-read when they change; a password file is re-read for
//! each new connection, so a rotated Secret is used without a restart.

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
}

/// Notices a Redis that stopped answering without waiting for each command's timeout: while
/// commands are outstanding, how long since the last one was sent to an idle, answering
/// connection or answered. A command that timed out or lost its connection is no answer: the
/// silence it began goes on with the next command.
struct Progress {
    base: std::time::Instant,
    in_flight: AtomicUsize,
    since_us: AtomicU64,
    /// The last command ended without an answer from Redis.
    silent: AtomicBool,
}

struct Outstanding<'a> {
    progress: &'a Progress,
    /// Whether Redis answered the command; `None` when the caller gave up on it first (it then
    /// says nothing about Redis).
    answered: Option<bool>,
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

impl Conn {
    /// `WAIT replicas timeout_ms` on the primary that holds `key` (on one server, that
    /// server): the replicas a cluster primary counts are its own.
    pub async fn wait_for_replicas(&mut self, key: &str, replicas: u32, timeout_ms: u64) -> Result<i64, RedisError> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(timeout_ms);
        match self {
            Self::Single(c) => wait.query_async(c).await,
            Self::Cluster(c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let primary = Route::new(crate::session::cluster_slot(key.as_bytes()), SlotAddr::Master);
                let node = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(primary));
                let reply = c.route_command(wait, node).await?;
                redis::from_redis_value(reply).map_err(RedisError::from)
            }
        }
    }
}

/// How many times a cluster command is retried (after a `MOVED`, `TRYAGAIN`, a lost node…)
/// and how long the client waits between tries: a few short waits, so a command ends within
/// a lock budget instead of redis-rs' default of 16 tries over seconds.
const CLUSTER_RETRIES: u32 = 3;
const CLUSTER_MIN_RETRY_WAIT_MS: u64 = 5;
const CLUSTER_MAX_RETRY_WAIT_MS: u64 = 100;

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

    /// Over TLS 1.3 a server that refuses the client's certificate says so only after the
    /// handshake, in an alert the client reads: one `PING` on a raw TLS stream reads it, so a
    /// missing or unaccepted client certificate is told apart from a server that is down.
    async fn probe_tls(&self) -> Result<(), Failure> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (host, port) = match &self.inner.source {
            Source::Tls { host, port, .. } => (host.clone(), *port),
            Source::Sentinel { tls: true, .. } => {
                let client = self.sentinel_client().await?;
                match client.get_connection_info().addr() {
                    ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
                    _ => return Ok(()),
                }
            }
            _ => return Ok(()),
        };
        let mut stream = self.tls_stream(&host, port).await?;
        let refused = |e: std::io::Error| {
            if e.get_ref().is_some_and(|i| i.is::<rustls::Error>()) {
                Failure::Refused(io_error(&format!("TLS: {e} (check --redis-cert and --redis-key)")))
            } else {
                Failure::Unreachable(RedisError::from(e))
            }
        };
        stream.write_all(b"*1\r\n$4\r\nPING\r\n").await.map_err(refused)?;
        stream.flush().await.map_err(refused)?;
        let mut reply = [0u8; 64];
        match tokio::time::timeout(self.inner.connect_timeout, stream.read(&mut reply)).await {
            Ok(Ok(0)) => Err(Failure::Refused(io_error(
                "Redis closed the connection after the TLS handshake (does it require a client certificate? --redis-cert, --redis-key)",
            ))),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(refused(e)),
            Err(_) => Err(Failure::Unreachable(io_error("no answer to PING over TLS"))),
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

    /// Opens a new connection to the one server, or the primary Sentinel names.
    async fn connect_single(&self) -> Result<MultiplexedConnection, Failure> {
        let config = &self.inner.config;
        match &self.inner.source {
            Source::Direct(info) => {
                let info = info
                    .clone()
                    .set_redis_settings(self.credentials(info.redis_settings())?);
                let client = Client::open(info).map_err(Failure::Refused)?;
                client
                    .get_multiplexed_async_connection_with_config(config)
                    .await
                    .map_err(Failure::of)
            }
            Source::Tls { host, port, info } => self.connect_tls(host, *port, info).await,
            Source::Sentinel { tls: false, .. } => {
                let client = self.sentinel_client().await?;
                client
                    .get_multiplexed_async_connection_with_config(config)
                    .await
                    .map_err(Failure::of)
            }
            Source::Sentinel { tls: true, .. } => {
                let client = self.sentinel_client().await?;
                let info = client.get_connection_info();
                match info.addr() {
                    ConnectionAddr::TcpTls { host, port, .. } => {
                        self.connect_tls(host, *port, info.redis_settings()).await
                    }
                    _ => Err(Failure::Unreachable(io_error("Sentinel named no TLS address"))),
                }
            }
            Source::Cluster { .. } => Err(Failure::Refused(io_error("a cluster has no single server"))),
        }
    }

    /// Whether the URL names a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.inner.source, Source::Cluster { .. })
    }

    /// A cluster connection of its own for sharded pub/sub (`SSUBSCRIBE`, RESP3): the
    /// messages and the client's re-subscriptions after a topology change arrive on the
    /// returned receiver.
    pub async fn cluster_pubsub(
        &self,
    ) -> Result<(ClusterConnection, tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>), RedisError> {
        let Source::Cluster { spec, tls, .. } = &self.inner.source else {
            return Err(io_error("not a cluster URL"));
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let client = build_cluster(
            spec,
            *tls,
            &self.inner.options,
            self.inner.tls.as_ref(),
            self.inner.config_response_timeout(),
            Some(tx),
        )
        .map_err(|e| io_error(&e.to_string()))?;
        let conn = tokio::time::timeout(self.inner.connect_timeout * 2, client.get_async_connection())
            .await
            .map_err(|_| io_error("no cluster node answered"))??;
        Ok((conn, rx))
    }

    async fn connect_tls(
        &self,
        host: &str,
        port: u16,
        info: &RedisConnectionInfo,
    ) -> Result<MultiplexedConnection, Failure> {
        let stream = self.tls_stream(host, port).await?;
        let info = self.credentials(info)?;
        let handshake = MultiplexedConnection::new_with_config(&info, stream, self.inner.config.clone());
        let (conn, driver) = match tokio::time::timeout(self.inner.connect_timeout, handshake).await {
            Ok(r) => r.map_err(Failure::of)?,
            Err(_) => return Err(Failure::Unreachable(io_error("no answer to the connection handshake"))),
        };
        tokio::spawn(driver);
        Ok(conn)
    }

    async fn tls_stream(
        &self,
        host: &str,
        port: u16,
    ) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, Failure> {
        let Some(tls) = &self.inner.tls else {
            return Err(Failure::Refused(io_error("no TLS configuration")));
        };
        tls.connect(host, port, self.inner.connect_timeout).await.map_err(|e| {
            let refused = matches!(&e, ConnectError::Handshake { source, .. } if source.get_ref().is_some_and(|i| i.is::<rustls::Error>()));
            let error = io_error(&e.to_string());
            if refused {
                Failure::Refused(error)
            } else {
                Failure::Unreachable(error)
            }
        })
    }

    /// The connection's credentials: the URL's, with `--redis-username` and the password
    /// file (read now, so a rotated Secret is used by the next connection) over them.
    fn credentials(&self, base: &RedisConnectionInfo) -> Result<RedisConnectionInfo, Failure> {
        // No `CLIENT SETINFO` at connect: one command fewer for the ACL to allow.
        let mut info = base.clone().set_skip_set_lib_name();
        if let Some(user) = &self.inner.options.username {
            info = info.set_username(user);
        }
        if let Some(path) = &self.inner.options.password_file {
            let pw = read_password(path).map_err(|e| Failure::Refused(io_error(&e)))?;
            info = info.set_password(pw);
        }
        Ok(info)
    }

    /// The client for the primary Sentinel names now (rebuilt first when the TLS files changed).
    async fn sentinel_client(&self) -> Result<Client, Failure> {
        let Source::Sentinel {
            client,
            spec,
            tls,
            stale,
            ..
        } = &self.inner.source
        else {
            return Err(Failure::Refused(io_error("not a Sentinel URL")));
        };
        let mut sentinel = client.lock().await;
        if stale.swap(false, Ordering::AcqRel) {
            match build_sentinel(spec, *tls, &self.inner.options, self.inner.tls.as_ref()) {
                Ok(fresh) => *sentinel = fresh,
                Err(error) => tracing::warn!(%error, "cannot rebuild the Sentinel client with the new TLS files"),
            }
        }
        sentinel.async_get_client().await.map_err(Failure::of)
    }

    /// A pub/sub connection to the current primary (its own connection, same TLS and
    /// credentials).
    pub async fn pubsub(&self) -> Result<PubSub, RedisError> {
        let (host, port, info) = match &self.inner.source {
            Source::Direct(info) => {
                let info = info
                    .clone()
                    .set_redis_settings(self.credentials(info.redis_settings()).map_err(Failure::into_error)?);
                return Client::open(info)?.get_async_pubsub().await;
            }
            Source::Tls { host, port, info } => (host.clone(), *port, info.clone()),
            Source::Sentinel { tls, .. } => {
                let client = self.sentinel_client().await.map_err(Failure::into_error)?;
                if !*tls {
                    return client.get_async_pubsub().await;
                }
                match client.get_connection_info().addr() {
                    ConnectionAddr::TcpTls { host, port, .. } => (
                        host.clone(),
                        *port,
                        client.get_connection_info().redis_settings().clone(),
                    ),
                    _ => return Err(io_error("Sentinel named no TLS address")),
                }
            }
            Source::Cluster { .. } => return Err(io_error("a cluster uses sharded pub/sub (cluster_pubsub)")),
        };
        let stream = self.tls_stream(&host, port).await.map_err(Failure::into_error)?;
        let info = self.credentials(&info).map_err(Failure::into_error)?;
        PubSub::new(&info, stream).await
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

impl RedisConn {
    /// Like [`RedisConn::run`], but a command lost with its connection (the connection was cut:
    /// reset, broken pipe) is sent once more on a new connection. Only for commands that are
    /// safe to apply twice, such as a release compared against its token. Returns the result
    /// and whether it was sent again (then a "not held" answer may mean the first attempt ran).
    pub async fn run_resent<T, F, Fut>(&self, f: F) -> Result<(T, bool), RedisError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        match self.run(&f).await {
            Err(e) if needs_reconnect(&e) => {
                tracing::debug!(error = %e, "Redis connection lost under a command: sending it again on a new one");
                self.run(&f).await.map(|t| (t, true))
            }
            other => other.map(|t| (t, false)),
        }
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

/// A cluster client for `spec`: the URL's credentials (the password file's over them, read
/// now), TLS with the same files, and retries fitted to a lock budget. With `push`, the
/// connection speaks RESP3 and delivers sharded pub/sub messages there.
fn build_cluster(
    spec: &ClusterSpec,
    tls: bool,
    options: &ConnOptions,
    files: Option<&Tls>,
    response_timeout: Duration,
    push: Option<tokio::sync::mpsc::UnboundedSender<redis::PushInfo>>,
) -> Result<ClusterClient, ConnError> {
    let scheme = if tls { "rediss" } else { "redis" };
    let nodes: Vec<String> = spec
        .hosts
        .iter()
        .map(|(h, p)| format!("{scheme}://{}:{p}", crate::redis_url::bracket(h)))
        .collect();
    let mut builder = ClusterClientBuilder::new(nodes)
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(CLUSTER_MIN_RETRY_WAIT_MS)
        .max_retry_wait(CLUSTER_MAX_RETRY_WAIT_MS)
        .retry_wait_formula(10, 2)
        .connection_timeout(response_timeout.max(Duration::from_millis(200)))
        .response_timeout(response_timeout);
    let password = match &options.password_file {
        Some(path) => Some(read_password(path).map_err(ConnError::Setting)?),
        None => spec.password.clone(),
    };
    if let Some(user) = options.username.clone().or_else(|| spec.username.clone()) {
        builder = builder.username(user);
    }
    if let Some(pass) = password {
        builder = builder.password(pass);
    }
    if tls {
        builder = builder.tls(TlsMode::Secure);
        if let Some(certs) = files
            .map(Tls::certificates)
            .transpose()
            .map_err(|e| ConnError::Setting(e.to_string()))?
            .flatten()
        {
            builder = builder.certs(certs);
        }
    }
    if let Some(tx) = push {
        builder = builder.use_protocol(redis::ProtocolVersion::RESP3).push_sender(tx);
    }
    builder
        .build()
        .map_err(|e| ConnError::Setting(format!("Redis Cluster: {e}")))
}

/// A Sentinel client for `spec`: plaintext, or TLS to the Sentinels and the primary with the
/// same files.
fn build_sentinel(
    spec: &SentinelSpec,
    tls: bool,
    options: &ConnOptions,
    files: Option<&Tls>,
) -> Result<SentinelClient, ConnError> {
    let invalid = |e: RedisError| ConnError::Setting(format!("Sentinel: {e}"));
    let password = match &options.password_file {
        Some(path) => Some(read_password(path).map_err(ConnError::Setting)?),
        None => spec.password.clone(),
    };
    let username = options.username.clone().or_else(|| spec.username.clone());
    if !tls {
        let mut info = RedisConnectionInfo::default().set_db(spec.db);
        if let Some(user) = &username {
            info = info.set_username(user);
        }
        if let Some(pass) = &password {
            info = info.set_password(pass);
        }
        let primary = SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
        return SentinelClient::build(
            spec.node_urls(),
            spec.primary.clone(),
            Some(primary),
            SentinelServerType::Master,
        )
        .map_err(invalid);
    }
    let nodes = spec.hosts.iter().map(|(host, port)| ConnectionAddr::TcpTls {
        host: host.clone(),
        port: *port,
        insecure: false,
        tls_params: None,
    });
    let mut builder = SentinelClientBuilder::new(nodes, spec.primary.clone(), SentinelServerType::Master)
        .map_err(invalid)?
        .set_client_to_sentinel_tls_mode(TlsMode::Secure)
        .set_client_to_redis_tls_mode(TlsMode::Secure)
        .set_client_to_redis_db(spec.db);
    if let Some(user) = &username {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(pass) = &password {
        builder = builder.set_client_to_redis_password(pass);
    }
    if let Some(user) = &spec.sentinel_username {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(pass) = &spec.sentinel_password {
        builder = builder.set_client_to_sentinel_password(pass);
    }
    if let Some(certs) = files
        .map(Tls::certificates)
        .transpose()
        .map_err(|e| ConnError::Setting(e.to_string()))?
        .flatten()
    {
        builder = builder
            .set_client_to_sentinel_certificates(certs.clone())
            .set_client_to_redis_certificates(certs);
    }
    builder.build().map_err(invalid)
}

// === impl Progress ===

impl Inner {
    fn config_response_timeout(&self) -> Duration {
        self.response_timeout
    }
}

impl Progress {
    fn new() -> Self {
        Self {
            base: std::time::Instant::now(),
            in_flight: AtomicUsize::new(0),
            since_us: AtomicU64::new(0),
            silent: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn now_us(&self) -> u64 {
        self.base.elapsed().as_micros() as u64
    }

    fn begin(&self) -> Outstanding<'_> {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) == 0 && !self.silent.load(Ordering::Acquire) {
            self.since_us.store(self.now_us(), Ordering::Release);
        }
        Outstanding {
            progress: self,
            answered: None,
        }
    }

    fn stalled_for(&self) -> Duration {
        if self.in_flight.load(Ordering::Acquire) == 0 {
            return Duration::ZERO;
        }
        let since = self.since_us.load(Ordering::Acquire);
        Duration::from_micros(self.now_us().saturating_sub(since))
    }
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        let p = self.progress;
        if let Some(answered) = self.answered {
            if answered {
                p.since_us.store(p.now_us(), Ordering::Release);
            }
            p.silent.store(!answered, Ordering::Release);
        }
        p.in_flight.fetch_sub(1, Ordering::AcqRel);
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
#[derive(Clone, Debug)]
pub struct Entry {
    pub key: String,
    pub value: Bytes,
    pub ttl: Duration,
    pub expect: Option<Bytes>,
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
