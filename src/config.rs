//! The proxy's configuration (`turnlock proxy`): every flag has an environment variable
//! `TURNLOCK_<NAME>`; the defaults and bounds are here, with the crate's configuration error.
//! Each other subcommand's arguments live with its module.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::Args;

/// Longest `--session-ttl-secs`: ten years.
const MAX_SESSION_TTL_SECS: u64 = 10 * 365 * 24 * 3600;

#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// Address the agent connects to.
    #[arg(long, env = "TURNLOCK_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// The context store's base URL.
    #[arg(long, env = "TURNLOCK_UPSTREAM", default_value = "http://127.0.0.1:8080")]
    pub upstream: String,
    /// Redis URL (redis://… or redis+sentinel://host:port,…/primary). Without it, an in-memory
    /// backend serializes only the writers inside this one process.
    #[arg(long, env = "TURNLOCK_REDIS")]
    pub redis: Option<String>,
    /// Admin address: /metrics, /healthz, /readyz.
    #[arg(long, env = "TURNLOCK_ADMIN", default_value = "127.0.0.1:9901")]
    pub admin: SocketAddr,
    /// Serve /metrics to callers other than loopback (probes are always served).
    #[arg(long, env = "TURNLOCK_ADMIN_PUBLIC_METRICS", value_parser = BoolishValueParser::new())]
    pub admin_public_metrics: bool,
    /// How long a leader waits for its session's lock in one round, in milliseconds, before
    /// it answers the writes past their wait deadline and lets the session's other turns take
    /// their turn; also how long a holder waits for another turn's commit in flight. A write
    /// itself waits until its `--wait-deadline-ms`.
    #[arg(long, env = "TURNLOCK_LOCK_BUDGET_MS", default_value_t = 50)]
    pub lock_budget_ms: u64,
    /// Lock lease, in milliseconds; renewed while a slow write holds it.
    #[arg(long, env = "TURNLOCK_LOCK_TTL_MS", default_value_t = 2000)]
    pub lock_ttl_ms: u64,
    /// Prefix of every Redis key turnlock writes.
    #[arg(long, env = "TURNLOCK_KEY_PREFIX", default_value = "turnlock:")]
    pub key_prefix: String,
    /// Largest write body accepted, in bytes.
    #[arg(long, env = "TURNLOCK_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,
    /// A TOML file mapping other stores' write endpoints (see the README).
    #[arg(long, env = "TURNLOCK_ROUTES")]
    pub routes: Option<String>,
    /// Path prefix of the canonical session API.
    #[arg(long, env = "TURNLOCK_SESSION_PREFIX", default_value = "/v1/sessions")]
    pub session_prefix: String,
    /// How long an idempotency record is kept, in seconds.
    #[arg(long, env = "TURNLOCK_IDEMPOTENCY_TTL_SECS", default_value_t = 24 * 3600)]
    pub idempotency_ttl_secs: u64,
    /// How long a version snapshot for three-way merges is kept, in seconds.
    #[arg(long, env = "TURNLOCK_HISTORY_TTL_SECS", default_value_t = 600)]
    pub history_ttl_secs: u64,
    /// How long the store may take to answer, in milliseconds.
    #[arg(long, env = "TURNLOCK_UPSTREAM_TIMEOUT_MS", default_value_t = 5000)]
    pub upstream_timeout_ms: u64,
    /// How long one Redis command may take before the connection is treated as broken.
    #[arg(long, env = "TURNLOCK_REDIS_TIMEOUT_MS", default_value_t = 500)]
    pub redis_timeout_ms: u64,
    /// Replicas that must acknowledge a lock grant (Redis `WAIT`, on a connection of its
    /// own) before the holder writes; 0 does not wait. With a replica, a failover cannot lose
    /// a grant the holder acted on; each grant costs one more round trip to the replica.
    #[arg(long, env = "TURNLOCK_REDIS_WAIT_REPLICAS", default_value_t = 0)]
    pub redis_wait_replicas: u32,
    /// How long a grant waits for its replica acknowledgements, in milliseconds; a grant not
    /// acknowledged in time is given back and the write answered `lock_unavailable`.
    #[arg(long, env = "TURNLOCK_REDIS_WAIT_TIMEOUT_MS", default_value_t = 50)]
    pub redis_wait_timeout_ms: u64,
    /// Most writes merged into one read-merge-write.
    #[arg(long, env = "TURNLOCK_MAX_BATCH", default_value_t = 128)]
    pub max_batch: usize,
    /// How long in-flight writes may take to finish at shutdown, in milliseconds.
    #[arg(long, env = "TURNLOCK_SHUTDOWN_GRACE_MS", default_value_t = 10_000)]
    pub shutdown_grace_ms: u64,
    /// Transparent interception: forward each connection to its original destination
    /// (`SO_ORIGINAL_DST`, set by `turnlock init-iptables` rules) instead of `--upstream`, which
    /// then serves only connections made to the proxy directly.
    #[arg(long, env = "TURNLOCK_TRANSPARENT", value_parser = BoolishValueParser::new())]
    pub transparent: bool,
    /// How long a session's Redis keys (fencing counter, turn marks) outlive its last write,
    /// in seconds. A session written again after that starts from what the store holds.
    #[arg(long, env = "TURNLOCK_SESSION_TTL_SECS", default_value_t = 7 * 24 * 3600)]
    pub session_ttl_secs: u64,
    /// Largest session document a write may produce, in bytes; a merged PUT (a whole
    /// document) may be this large even when it is over --max-body-bytes.
    #[arg(long, env = "TURNLOCK_MAX_DOCUMENT_BYTES", default_value_t = 8 * 1024 * 1024)]
    pub max_document_bytes: usize,
    /// Most connections open to the store at once; a request past the cap waits (within
    /// `--upstream-timeout-ms`) for one to come back.
    #[arg(long, env = "TURNLOCK_UPSTREAM_MAX_CONNECTIONS", default_value_t = 256)]
    pub upstream_max_connections: usize,
    /// How long an idle connection to the store is kept open, in milliseconds. Keep it below
    /// the store's (or its load balancer's) own idle timeout.
    #[arg(long, env = "TURNLOCK_UPSTREAM_IDLE_TIMEOUT_MS", default_value_t = 30_000)]
    pub upstream_idle_timeout_ms: u64,
    /// How long a write may queue for its turn (the lock, the commit slot, re-reads after a
    /// conflict), in milliseconds, before it is answered `session_busy`. A request may ask
    /// for a shorter wait with `X-Wait-Deadline-Ms`.
    #[arg(long, env = "TURNLOCK_WAIT_DEADLINE_MS", default_value_t = DEFAULT_WAIT_DEADLINE_MS)]
    pub wait_deadline_ms: u64,
    /// CA certificates (PEM) that an `https://` store's certificate may chain to, besides the
    /// system's roots.
    #[arg(long, env = "TURNLOCK_UPSTREAM_CA")]
    pub upstream_ca: Option<std::path::PathBuf>,
    /// PEM file of the CA(s) that sign the Redis server's certificate (`rediss://`); the
    /// system's roots when unset. Re-read when it changes.
    #[arg(long, env = "TURNLOCK_REDIS_CA")]
    pub redis_ca: Option<PathBuf>,
    /// PEM client certificate (chain) for mutual TLS with Redis; with `--redis-key`.
    #[arg(long, env = "TURNLOCK_REDIS_CERT")]
    pub redis_cert: Option<PathBuf>,
    /// PEM private key of `--redis-cert`.
    #[arg(long, env = "TURNLOCK_REDIS_KEY")]
    pub redis_key: Option<PathBuf>,
    /// The name the Redis server's certificate must carry, when the URL's host is not it
    /// (connecting by IP address).
    #[arg(long, env = "TURNLOCK_REDIS_TLS_SERVER_NAME")]
    pub redis_tls_server_name: Option<String>,
    /// Redis ACL user (over any user in the URL).
    #[arg(long, env = "TURNLOCK_REDIS_USERNAME")]
    pub redis_username: Option<String>,
    /// File holding the Redis password (a mounted Secret), over any password in the URL;
    /// re-read for each new connection.
    #[arg(long, env = "TURNLOCK_REDIS_PASSWORD_FILE")]
    pub redis_password_file: Option<PathBuf>,
}

/// The default wait deadline: room for a few dozen read-merge-writes (tens of ms each) of
/// one session queued ahead, below the store timeout (5 s) so that a client that gives up
/// with it (and the idempotency claim of a waiting write) outlasts the wait.
pub const DEFAULT_WAIT_DEADLINE_MS: u64 = 3000;

/// Longest lock lease accepted: a lease is renewed while held, so a longer one only delays
/// recovery from a crashed holder.
pub const MAX_LOCK_TTL_MS: u64 = 600_000;
/// Longest a write may wait for its lock.
pub const MAX_LOCK_BUDGET_MS: u64 = 60_000;
/// Longest record or snapshot lifetime (Redis rejects expiries that overflow).
pub const MAX_TTL_SECS: u64 = 365 * 24 * 3600;
/// Longest Redis, store or shutdown timeout.
pub const MAX_TIMEOUT_MS: u64 = 600_000;

/// Bad configuration: reported with a clear message and exit code 64 (EX_USAGE).
#[derive(Debug, thiserror::Error)]
#[error("configuration error: {0}")]
pub struct ConfigError(pub String);

/// Exit code for bad configuration (EX_USAGE).
pub const EXIT_USAGE: u8 = 64;
/// Exit code when a backend could not be set up at start (EX_UNAVAILABLE).
pub const EXIT_BACKEND: u8 = 69;
/// Exit code when an address cannot be listened on (EX_OSERR): in use, or not this host's.
pub const EXIT_BIND: u8 = 71;

/// Why a server did not start; each kind has its own exit code ([`StartError::exit_code`]).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The address cannot be listened on.
    #[error("cannot listen on {what}{addr}: {source}")]
    Bind {
        /// What the address is for, when not the main one (`"admin address "`).
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// A backend (Redis) could not be set up.
    #[error("backend unavailable: {0}")]
    Backend(String),
}

impl StartError {
    /// A bind failure for `addr`.
    pub fn bind(addr: SocketAddr, source: std::io::Error) -> Self {
        Self::Bind { what: "", addr, source }
    }

    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Config(_) => EXIT_USAGE,
            Self::Backend(_) => EXIT_BACKEND,
            Self::Bind { .. } => EXIT_BIND,
        }
    }
}

impl ProxyArgs {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |m: &str| Err(ConfigError(m.to_owned()));
        if !self.transparent && upstream_is_listen_address(&self.upstream, self.listen) {
            return Err(ConfigError(format!(
                "--upstream {} is this proxy's own --listen address {}: every request would loop back into it",
                self.upstream, self.listen
            )));
        }
        if self.lock_budget_ms == 0 {
            return err("--lock-budget-ms must be at least 1");
        }
        if self.wait_deadline_ms == 0 || self.wait_deadline_ms > MAX_LOCK_BUDGET_MS {
            return err("--wait-deadline-ms must be between 1 and 60000");
        }
        if self.session_ttl_secs == 0 || self.session_ttl_secs > MAX_SESSION_TTL_SECS {
            return err("--session-ttl-secs must be between 1 and 315360000 (ten years)");
        }
        if !(10..=MAX_LOCK_TTL_MS).contains(&self.lock_ttl_ms) {
            return err("--lock-ttl-ms must be between 10 and 600000 (ten minutes)");
        }
        if self.lock_budget_ms > MAX_LOCK_BUDGET_MS {
            return err("--lock-budget-ms must be at most 60000");
        }
        if self.idempotency_ttl_secs == 0 || self.idempotency_ttl_secs > MAX_TTL_SECS {
            return err("--idempotency-ttl-secs must be between 1 and 31536000 (one year)");
        }
        if self.history_ttl_secs == 0 || self.history_ttl_secs > MAX_TTL_SECS {
            return err("--history-ttl-secs must be between 1 and 31536000 (one year)");
        }
        if self.redis_timeout_ms == 0 || self.redis_timeout_ms > MAX_TIMEOUT_MS {
            return err("--redis-timeout-ms must be between 1 and 600000");
        }
        if self.upstream_timeout_ms == 0 || self.upstream_timeout_ms > MAX_TIMEOUT_MS {
            return err("--upstream-timeout-ms must be between 1 and 600000");
        }
        if self.redis_wait_timeout_ms > MAX_TIMEOUT_MS {
            return err("--redis-wait-timeout-ms must be at most 600000");
        }
        if self.upstream_max_connections == 0 || self.upstream_max_connections > 65_536 {
            return err("--upstream-max-connections must be between 1 and 65536");
        }
        if self.upstream_idle_timeout_ms == 0 || self.upstream_idle_timeout_ms > MAX_TIMEOUT_MS {
            return err("--upstream-idle-timeout-ms must be between 1 and 600000");
        }
        if self.shutdown_grace_ms > MAX_TIMEOUT_MS {
            return err("--shutdown-grace-ms must be at most 600000");
        }
        if self.redis_wait_replicas > 0 && (self.redis.is_none() || self.redis_wait_timeout_ms == 0) {
            return err("--redis-wait-replicas needs --redis and a positive --redis-wait-timeout-ms");
        }
        if self.redis_wait_replicas > 0 && self.redis_wait_timeout_ms >= self.lock_ttl_ms {
            return err("--redis-wait-timeout-ms must be shorter than --lock-ttl-ms");
        }
        if self.max_document_bytes == 0 {
            return err("--max-document-bytes must be positive");
        }
        if self.max_body_bytes == 0 || self.max_batch == 0 {
            return err("--max-body-bytes and --max-batch must be positive");
        }
        if !self.session_prefix.starts_with('/') {
            return err("--session-prefix must start with '/'");
        }
        let redis_settings = self.redis_ca.is_some()
            || self.redis_cert.is_some()
            || self.redis_key.is_some()
            || self.redis_tls_server_name.is_some()
            || self.redis_username.is_some()
            || self.redis_password_file.is_some();
        if redis_settings && self.redis.is_none() {
            return err("--redis-ca, --redis-cert, --redis-key, --redis-tls-server-name, --redis-username and --redis-password-file need --redis");
        }
        if self
            .redis_username
            .as_deref()
            .is_some_and(|u| u.is_empty() || u.contains(char::is_whitespace))
        {
            return err("--redis-username must be a non-empty name without spaces");
        }
        if self.key_prefix.contains(['*', '?', '[', ']']) {
            return err("--key-prefix may not contain Redis glob characters");
        }
        if self.key_prefix.contains(['{', '}']) {
            return err("--key-prefix may not contain '{' or '}': the session id is the keys' Redis Cluster hash tag");
        }
        Ok(())
    }

    /// How to connect to Redis besides the URL: TLS files and credentials.
    pub fn redis_options(&self) -> crate::redis_conn::ConnOptions {
        crate::redis_conn::ConnOptions {
            tls: crate::redis_tls::TlsFiles {
                ca: self.redis_ca.clone(),
                cert: self.redis_cert.clone(),
                key: self.redis_key.clone(),
                server_name: self.redis_tls_server_name.clone(),
            },
            username: self.redis_username.clone(),
            password_file: self.redis_password_file.clone(),
        }
    }

    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lock_ttl_ms)
    }

    /// Defaults for an in-process proxy (tests, demo, benchmarks).
    pub fn local(upstream: String) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            upstream,
            redis: None,
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_public_metrics: false,
            lock_budget_ms: 50,
            lock_ttl_ms: 2000,
            key_prefix: "turnlock:".into(),
            max_body_bytes: 1024 * 1024,
            routes: None,
            session_prefix: "/v1/sessions".into(),
            idempotency_ttl_secs: 24 * 3600,
            history_ttl_secs: 600,
            upstream_timeout_ms: 5000,
            redis_timeout_ms: 500,
            redis_wait_replicas: 0,
            redis_wait_timeout_ms: 50,
            max_batch: 128,
            shutdown_grace_ms: 10_000,
            transparent: false,
            session_ttl_secs: 7 * 24 * 3600,
            max_document_bytes: 8 * 1024 * 1024,
            upstream_max_connections: 256,
            upstream_idle_timeout_ms: 30_000,
            wait_deadline_ms: DEFAULT_WAIT_DEADLINE_MS,
            upstream_ca: None,
            redis_ca: None,
            redis_cert: None,
            redis_key: None,
            redis_tls_server_name: None,
            redis_username: None,
            redis_password_file: None,
        }
    }
}

/// Whether `upstream` names the address the proxy listens on (the same port on the same
/// address, on loopback while listening on loopback, or on any address while listening on
/// all of them): the proxy would forward every request to itself.
fn upstream_is_listen_address(upstream: &str, listen: SocketAddr) -> bool {
    let Ok(uri) = upstream.parse::<http::Uri>() else {
        return false;
    };
    let port = uri
        .port_u16()
        .unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 });
    let Some(host) = uri.host() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let host = host.strip_suffix('.').unwrap_or(host);
    let ips: Vec<std::net::IpAddr> = if host.eq_ignore_ascii_case("localhost") {
        vec![[127, 0, 0, 1].into(), std::net::Ipv6Addr::LOCALHOST.into()]
    } else if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        vec![ip]
    } else if host
        .bytes()
        .all(|b| b.is_ascii_hexdigit() || b == b'.' || b == b'x' || b == b'X')
    {
        // The numeric spellings the resolver also takes (`127.1`, `2130706433`, `0x7f000001`):
        // resolved as numbers, without asking DNS.
        use std::net::ToSocketAddrs;
        (host, port)
            .to_socket_addrs()
            .map(|a| a.map(|a| a.ip()).collect())
            .unwrap_or_default()
    } else {
        return false;
    };
    let local = |ip: std::net::IpAddr| ip.is_loopback() || ip.is_unspecified();
    ips.into_iter().map(|ip| ip.to_canonical()).any(|ip| {
        port == listen.port()
            && (ip == listen.ip() || listen.ip().is_unspecified() || (local(ip) && listen.ip().is_loopback()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_prefix_with_a_hash_tag_brace_is_refused() {
        for prefix in ["tl{", "}tl:", "{a}:"] {
            let mut args = ProxyArgs::local("http://127.0.0.1:1".into());
            args.key_prefix = prefix.into();
            let e = args.validate().expect_err(prefix);
            assert!(e.to_string().contains("hash tag"), "{prefix}: {e}");
        }
        let mut args = ProxyArgs::local("http://127.0.0.1:1".into());
        args.key_prefix = "team-a:turnlock:".into();
        assert!(args.validate().is_ok());
    }

    #[test]
    fn a_store_at_the_proxys_own_address_is_refused() {
        let listen: SocketAddr = "127.0.0.1:7070".parse().unwrap();
        for upstream in [
            "http://127.0.0.1:7070",
            "http://localhost:7070/",
            "http://127.0.0.2:7070",
        ] {
            assert!(upstream_is_listen_address(upstream, listen), "{upstream}");
        }
        let any: SocketAddr = "0.0.0.0:80".parse().unwrap();
        assert!(upstream_is_listen_address("http://10.0.0.5", any));
        for upstream in ["http://127.0.0.1:8080", "http://store.local:7070", "https://127.0.0.1"] {
            assert!(!upstream_is_listen_address(upstream, listen), "{upstream}");
        }
        let mut args = ProxyArgs::local("http://127.0.0.1:7070".into());
        args.listen = listen;
        let e = args.validate().expect_err("loop");
        assert!(e.to_string().contains("loop back"), "{e}");
    }
}
