//! One shared Redis connection that follows the server: reconnects after a restart or a
//! network cut, and re-resolves the primary through Sentinel after a failover.
//!
//! URLs: `redis://[user:pass@]host:port[/db]` for one server, and
//! `redis+sentinel://[user:pass@]host:port[,host:port…]/<primary-name>[/db][?sentinel_username=U&sentinel_password=P]`
//! for Sentinel: the credentials before `@` and the `/db` are the primary's; the Sentinels'
//! own credentials, when they require any, go in the query.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{AsyncConnectionConfig, Client, RedisConnectionInfo, RedisError};
use tokio::sync::Mutex;

/// How long one command may take before the connection is treated as broken.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("invalid Redis URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
}

#[derive(Clone)]
pub struct RedisConn {
    inner: Arc<Inner>,
}

struct Inner {
    source: Source,
    config: AsyncConnectionConfig,
    /// The live connection: read on every command (a brief shared lock, never held across
    /// an await), replaced after a failure.
    current: std::sync::RwLock<Option<MultiplexedConnection>>,
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
    silent: std::sync::atomic::AtomicBool,
}

struct Outstanding<'a> {
    progress: &'a Progress,
    /// Whether Redis answered the command; `None` when the caller gave up on it first (it then
    /// says nothing about Redis).
    answered: Option<bool>,
}

enum Source {
    Direct(Client),
    Sentinel(Mutex<SentinelClient>),
}

impl RedisConn {
    /// Parses the URL; no connection is made until the first command.
    pub fn open(url: &str, response_timeout: Duration) -> Result<Self, ConnError> {
        // Neither the URL nor the parser's reason may carry the password into a log.
        let shown = redact(url);
        let secrets = secrets_of(url);
        let invalid = |reason: &str| ConnError::InvalidUrl {
            url: shown.clone(),
            reason: secrets
                .iter()
                .filter(|s| !s.is_empty())
                .fold(reason.to_owned(), |r, s| r.replace(s, "***")),
        };
        let source = if let Some(rest) = url.strip_prefix("redis+sentinel://") {
            let spec = SentinelSpec::parse(rest).map_err(&invalid)?;
            let client = SentinelClient::build(
                spec.nodes.clone(),
                spec.primary.clone(),
                Some(spec.primary_connection()),
                SentinelServerType::Master,
            )
            .map_err(|e| invalid(&e.to_string()))?;
            Source::Sentinel(Mutex::new(client))
        } else if url.starts_with("redis://") || url.starts_with("unix://") {
            Source::Direct(Client::open(url).map_err(|e| invalid(&e.to_string()))?)
        } else {
            return Err(invalid("expected redis:// or redis+sentinel://"));
        };
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(response_timeout.max(Duration::from_millis(200))))
            .set_response_timeout(Some(response_timeout));
        Ok(Self {
            inner: Arc::new(Inner {
                source,
                config,
                current: std::sync::RwLock::new(None),
                connecting: Mutex::new(()),
                display: redact(url),
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
    pub async fn get(&self) -> Result<MultiplexedConnection, RedisError> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _connecting = self.inner.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let client = self.client().await?;
        let conn = client
            .get_multiplexed_async_connection_with_config(&self.inner.config)
            .await?;
        if let Ok(mut current) = self.inner.current.write() {
            *current = Some(conn.clone());
        }
        Ok(conn)
    }

    fn current(&self) -> Option<MultiplexedConnection> {
        self.inner.current.read().ok().and_then(|c| c.clone())
    }

    /// A client for the current primary (for dedicated connections such as pub/sub).
    pub async fn client(&self) -> Result<Client, RedisError> {
        match &self.inner.source {
            Source::Direct(c) => Ok(c.clone()),
            Source::Sentinel(s) => s.lock().await.async_get_client().await,
        }
    }

    /// Forgets the current connection after an error, so the next command reconnects (and,
    /// with Sentinel, asks which server is the primary now).
    pub async fn reset(&self) {
        if let Ok(mut current) = self.inner.current.write() {
            *current = None;
        }
    }

    /// Runs `f` on a connection; on an I/O-level failure the connection is dropped so the
    /// next call reconnects.
    pub async fn run<T, F, Fut>(&self, f: F) -> Result<T, RedisError>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
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

// === impl Progress ===

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

/// A parsed `redis+sentinel://` URL (after the scheme).
#[derive(Debug, PartialEq, Eq)]
struct SentinelSpec {
    /// `redis://[sentinel credentials@]host:port` for each Sentinel.
    nodes: Vec<String>,
    primary: String,
    username: Option<String>,
    password: Option<String>,
    db: i64,
}

impl SentinelSpec {
    fn parse(rest: &str) -> Result<Self, &'static str> {
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = rest.split_once('/').ok_or("missing /<primary-name>")?;
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (username, password) = match userinfo {
            None => (None, None),
            Some(u) => match u.split_once(':') {
                Some((user, pass)) => (Some(user.to_owned()).filter(|u| !u.is_empty()), Some(pass.to_owned())),
                None => (Some(u.to_owned()).filter(|u| !u.is_empty()), None),
            },
        };
        let mut parts = path.split('/');
        let primary = parts
            .next()
            .filter(|n| !n.is_empty())
            .ok_or("missing primary name")?
            .to_owned();
        let db = match parts.next().filter(|d| !d.is_empty()) {
            None => 0,
            Some(d) => d
                .parse::<i64>()
                .map_err(|_| "the database after the primary name must be a number")?,
        };
        if parts.next().is_some() {
            return Err("unexpected path after /<primary-name>/<db>");
        }
        let (mut s_user, mut s_pass) = (None, None);
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("sentinel_username", v)) => s_user = Some(v),
                Some(("sentinel_password", v)) => s_pass = Some(v),
                _ => return Err("unknown query parameter (expected sentinel_username, sentinel_password)"),
            }
        }
        let sentinel_auth = match (s_user, s_pass) {
            (None, None) => String::new(),
            (user, pass) => format!("{}:{}@", user.unwrap_or(""), pass.unwrap_or("")),
        };
        let nodes: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("redis://{sentinel_auth}{h}"))
            .collect();
        if nodes.is_empty() {
            return Err("no sentinel address");
        }
        Ok(Self {
            nodes,
            primary,
            username,
            password,
            db,
        })
    }

    /// How to connect to the primary the Sentinels name: its credentials and database.
    fn primary_connection(&self) -> SentinelNodeConnectionInfo {
        let mut info = RedisConnectionInfo::default().set_db(self.db);
        if let Some(user) = &self.username {
            info = info.set_username(user);
        }
        if let Some(pass) = &self.password {
            info = info.set_password(pass);
        }
        SentinelNodeConnectionInfo::default().set_redis_connection_info(info)
    }
}

/// The secrets in a URL: its credentials (`user:pass`, and the password alone) and any
/// `*password=` query value.
fn secrets_of(url: &str) -> Vec<&str> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut found = Vec::new();
    if let (Some(s), Some(at)) = (base.find("://"), base.rfind('@')) {
        if at > s + 3 {
            let userinfo = &base[s + 3..at];
            found.push(userinfo);
            if let Some((_, pass)) = userinfo.split_once(':') {
                found.push(pass);
            }
        }
    }
    for pair in query.split('&') {
        if let Some((k, v)) = pair.split_once('=') {
            if k.contains("password") {
                found.push(v);
            }
        }
    }
    found
}

fn redact(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((u, q)) => (u, Some(q)),
        None => (url, None),
    };
    let mut shown = match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_owned(),
    };
    if let Some(q) = query {
        let pairs: Vec<String> = q
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _)) if k.contains("password") => format!("{k}=***"),
                _ => p.to_owned(),
            })
            .collect();
        shown.push('?');
        shown.push_str(&pairs.join("&"));
    }
    shown
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
    fn urls_are_checked_and_redacted() {
        assert!(RedisConn::open("redis://127.0.0.1:6379", DEFAULT_RESPONSE_TIMEOUT).is_ok());
        assert!(RedisConn::open(
            "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/primary",
            DEFAULT_RESPONSE_TIMEOUT
        )
        .is_ok());
        assert!(RedisConn::open("redis+sentinel://127.0.0.1:26379", DEFAULT_RESPONSE_TIMEOUT).is_err());
        assert!(RedisConn::open("http://x", DEFAULT_RESPONSE_TIMEOUT).is_err());
        assert_eq!(redact("redis://user:secret@h:1/0"), "redis://***@h:1/0");
        assert_eq!(
            redact("redis+sentinel://:pw@h:1/p/2?sentinel_password=spw"),
            "redis+sentinel://***@h:1/p/2?sentinel_password=***"
        );
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

    #[test]
    fn sentinel_urls_give_the_primary_its_credentials_and_db_and_the_sentinels_theirs() {
        let spec = SentinelSpec::parse("app:pw@h1:1,h2:2/main/3?sentinel_password=spw").expect("parses");
        assert_eq!(spec.nodes, vec!["redis://:spw@h1:1", "redis://:spw@h2:2"]);
        assert_eq!(spec.primary, "main");
        assert_eq!(
            (spec.username.as_deref(), spec.password.as_deref()),
            (Some("app"), Some("pw"))
        );
        assert_eq!(spec.db, 3);
        let plain = SentinelSpec::parse("h1:1/main").expect("parses");
        assert_eq!(
            (plain.nodes, plain.password, plain.db),
            (vec!["redis://h1:1".to_owned()], None, 0)
        );
        assert!(SentinelSpec::parse("h1:1/main/x").is_err());
        assert!(SentinelSpec::parse("h1:1/main?other=1").is_err());
    }
}
