//! Transparent interception, for agents whose store URL cannot be changed.
//!
//! `turnlock init-iptables` (run once per pod, with `NET_ADMIN`, before the agent starts)
//! installs nat rules that REDIRECT the pod's outbound TCP traffic to the store's ports into
//! the sidecar, except the sidecar's own traffic (matched by its user id). The proxy, started
//! with `--transparent`, reads each accepted connection's original destination
//! (`SO_ORIGINAL_DST`) and forwards there: the lock and Redis path are the same as usual.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use http::{Request, Response};
use tokio::io::AsyncWriteExt;

use crate::config::ConfigError;
use crate::http::Body;
use crate::proxy::ProxyFactory;
use crate::proxy::{EdgeError, Proxy};
use crate::server::{is_own, Conn};

/// The nat chain holding turnlock's rules (jumped to from `OUTPUT`).
pub const OUTPUT_CHAIN: &str = "TURNLOCK_OUTPUT";
/// The nat chain that redirects into the sidecar.
pub const REDIRECT_CHAIN: &str = "TURNLOCK_REDIRECT";
/// Most original destinations one proxy keeps ready (each with its own connection pool and
/// write pipeline); past it, the least recently used one is dropped to make room.
pub const MAX_DESTINATIONS: usize = 64;
/// A destination not used for this long is dropped (pod IPs churn).
pub const DESTINATION_IDLE: Duration = Duration::from_secs(300);
/// iptables' `multiport` match takes at most this many ports.
const MAX_PORTS: usize = 15;

#[derive(Debug, Clone, Args)]
pub struct InitIptablesArgs {
    /// The store's port(s) whose outbound traffic is redirected (comma-separated).
    #[arg(long, env = "TURNLOCK_INTERCEPT_PORTS", value_delimiter = ',', required = true)]
    pub store_ports: Vec<u16>,
    /// The port the sidecar listens on.
    #[arg(long, env = "TURNLOCK_PROXY_PORT", default_value_t = 7070)]
    pub proxy_port: u16,
    /// The sidecar's user id: its own connections to the store are not redirected.
    #[arg(long, env = "TURNLOCK_PROXY_UID", default_value_t = 1337)]
    pub proxy_uid: u32,
    /// Print the rules instead of installing them.
    #[arg(long)]
    pub dry_run: bool,
    /// The `iptables` program (to remove an earlier jump to turnlock's chain).
    #[arg(long, env = "TURNLOCK_IPTABLES", default_value = "iptables")]
    pub iptables: String,
    /// The `iptables-restore` program to run.
    #[arg(long, env = "TURNLOCK_IPTABLES_RESTORE", default_value = "iptables-restore")]
    pub iptables_restore: String,
    /// IPv6 rules too: `auto` installs them when the network namespace has IPv6 (and fails if
    /// they cannot be installed there), `on` requires IPv6, `off` installs IPv4 rules only.
    #[arg(long, env = "TURNLOCK_IPV6", value_enum, default_value_t = Ipv6Rules::Auto)]
    pub ipv6: Ipv6Rules,
    /// The `ip6tables` program (to remove an earlier jump to turnlock's chain).
    #[arg(long, env = "TURNLOCK_IP6TABLES", default_value = "ip6tables")]
    pub ip6tables: String,
    /// The `ip6tables-restore` program to run.
    #[arg(long, env = "TURNLOCK_IP6TABLES_RESTORE", default_value = "ip6tables-restore")]
    pub ip6tables_restore: String,
}

/// Whether `init-iptables` installs the IPv6 rules (see [`InitIptablesArgs::ipv6`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Ipv6Rules {
    Auto,
    On,
    Off,
}

/// Whether this network namespace has IPv6: any interface holds an IPv6 address. Not the
/// `all.disable_ipv6` switch alone: an interface may turn IPv6 back on under it, and its
/// traffic would then pass by the sidecar.
pub fn namespace_has_ipv6() -> bool {
    std::fs::read_to_string("/proc/net/if_inet6").is_ok_and(|addresses| addresses.lines().any(|l| !l.trim().is_empty()))
}

impl InitIptablesArgs {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.store_ports.is_empty() || self.store_ports.len() > MAX_PORTS {
            return Err(ConfigError(format!("--store-ports takes 1 to {MAX_PORTS} ports")));
        }
        if self.store_ports.contains(&0) || self.proxy_port == 0 {
            return Err(ConfigError("ports must be between 1 and 65535".into()));
        }
        if self.store_ports.contains(&self.proxy_port) {
            return Err(ConfigError("--proxy-port may not be one of the --store-ports".into()));
        }
        Ok(())
    }
}

/// The `iptables-restore` input (nat table, applied with `--noflush`): outbound TCP to the store
/// ports from any user but the sidecar's goes to the sidecar's port. Declaring the two chains
/// empties them, so running it twice leaves one copy of each rule; the jump from `OUTPUT` is
/// removed first by [`run_init_iptables`].
pub fn nat_rules(args: &InitIptablesArgs) -> String {
    let ports = args
        .store_ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",");
    format!(
        "*nat\n\
         :{OUTPUT_CHAIN} - [0:0]\n\
         :{REDIRECT_CHAIN} - [0:0]\n\
         -A {REDIRECT_CHAIN} -p tcp -j REDIRECT --to-ports {proxy}\n\
         -A {OUTPUT_CHAIN} -m owner --uid-owner {uid} -j RETURN\n\
         -A {OUTPUT_CHAIN} -p tcp -m multiport --dports {ports} -j {REDIRECT_CHAIN}\n\
         -A OUTPUT -p tcp -j {OUTPUT_CHAIN}\n\
         COMMIT\n",
        proxy = args.proxy_port,
        uid = args.proxy_uid,
    )
}

/// Installs the rules (or prints them with `--dry-run`): the IPv4 rules with `iptables`, and
/// the same rules with `ip6tables` when [`InitIptablesArgs::ipv6`] says so. An IPv6 connection
/// to the store would otherwise bypass the sidecar, so a namespace with IPv6 whose rules cannot
/// be installed is a failure, not a warning.
pub async fn run_init_iptables(args: InitIptablesArgs) -> Result<ExitCode, ConfigError> {
    args.validate()?;
    let rules = nat_rules(&args);
    let ipv6 = match args.ipv6 {
        Ipv6Rules::Off => false,
        Ipv6Rules::On => {
            if !namespace_has_ipv6() {
                return Err(ConfigError(
                    "--ipv6 on: this network namespace has no IPv6 (or it is disabled)".into(),
                ));
            }
            true
        }
        Ipv6Rules::Auto => namespace_has_ipv6(),
    };
    if args.dry_run {
        print!("{rules}");
        if ipv6 {
            print!("# ip6tables-restore --noflush\n{rules}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    if !install(&args.iptables, &args.iptables_restore, &rules).await? {
        return Ok(ExitCode::FAILURE);
    }
    if ipv6 {
        if !install(&args.ip6tables, &args.ip6tables_restore, &rules).await? {
            return Ok(ExitCode::FAILURE);
        }
    } else {
        tracing::info!(
            ipv6 = ?args.ipv6,
            "no IPv6 rules installed: IPv6 is off or absent in this network namespace"
        );
    }
    tracing::info!(
        ports = ?args.store_ports,
        proxy_port = args.proxy_port,
        proxy_uid = args.proxy_uid,
        ipv6,
        "outbound store traffic now goes through the sidecar"
    );
    Ok(ExitCode::SUCCESS)
}

/// Applies `rules` with one family's programs (`iptables`/`iptables-restore` or their IPv6
/// counterparts); false when the restore program refused them.
async fn install(iptables: &str, restore: &str, rules: &str) -> Result<bool, ConfigError> {
    // A rerun (an init container restarted in the same network namespace) must not add a
    // second jump; the chains themselves are emptied by the restore.
    let _ = tokio::process::Command::new(iptables)
        .args(["-t", "nat", "-D", "OUTPUT", "-p", "tcp", "-j", OUTPUT_CHAIN])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    let mut child = tokio::process::Command::new(restore)
        .arg("--noflush")
        .stdin(Stdio::piped())
        .spawn()
        .map_err(|e| ConfigError(format!("cannot run {restore}: {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(rules.as_bytes())
            .await
            .map_err(|e| ConfigError(format!("cannot write to {restore}: {e}")))?;
    }
    let status = child
        .wait()
        .await
        .map_err(|e| ConfigError(format!("{restore} failed: {e}")))?;
    if !status.success() {
        eprintln!("turnlock: {restore} exited with {status}; rules were:\n{rules}");
        return Ok(false);
    }
    Ok(true)
}

/// Chooses the proxy (and so the store) each connection is forwarded to: its original
/// destination in transparent mode, else the configured `--upstream`.
#[derive(Clone)]
pub struct Destinations {
    inner: Arc<Inner>,
}

struct Inner {
    factory: ProxyFactory,
    default: Proxy,
    own: SocketAddr,
    /// This process's `Via` entry: a request that already carries it came back to us.
    via: http::HeaderValue,
    by_dst: Mutex<Cache<Proxy>>,
}

/// One store as the agent reached it: the original destination, and the `Host` it named
/// (name-based virtual hosting: two names at one address are two stores).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Destination {
    addr: SocketAddr,
    host: Option<http::HeaderValue>,
}

/// The proxies of recent destinations (`P` is [`Proxy`]; generic only for the tests).
struct Cache<P> {
    live: HashMap<Destination, Entry<P>>,
    /// Dropped from `live` while still serving requests: kept until idle, for the drain.
    retired: Vec<P>,
}

struct Entry<P> {
    proxy: P,
    used: Instant,
}

impl<P> Default for Cache<P> {
    fn default() -> Self {
        Self {
            live: HashMap::new(),
            retired: Vec::new(),
        }
    }
}

// === impl Destinations ===

impl Destinations {
    pub(crate) fn new(factory: ProxyFactory, default: Proxy, own: SocketAddr) -> Self {
        let via = http::HeaderValue::from_str(&format!("1.1 turnlock-{:016x}", rand::random::<u64>()))
            .unwrap_or_else(|_| http::HeaderValue::from_static("1.1 turnlock"));
        Self {
            inner: Arc::new(Inner {
                factory,
                default,
                own,
                via,
                by_dst: Mutex::new(Cache::default()),
            }),
        }
    }

    /// The service for one connection. The proxy is chosen here, once per connection, unless
    /// the connection was intercepted: its requests then name their store by `Host` as well,
    /// and each is looked up in the destination cache.
    pub fn for_connection(&self, conn: Conn) -> ConnService {
        let fixed = match conn.original_dst {
            Some(dst) if !is_own(dst, self.inner.own) => None,
            _ => Some(self.inner.default.clone()),
        };
        ConnService {
            destinations: self.clone(),
            conn,
            fixed,
        }
    }

    pub async fn handle(&self, req: Request<Body>, conn: Conn) -> Response<Body> {
        let proxy = match conn.original_dst {
            Some(dst) if !is_own(dst, self.inner.own) => {
                if self.came_back(&req) {
                    return forwarding_loop(dst);
                }
                let host = req.headers().get(http::header::HOST).cloned();
                match self.for_dst(Destination { addr: dst, host }) {
                    Ok(p) => p,
                    Err((code, message)) => return EdgeError::NoDestination { code, message }.into_response(),
                }
            }
            _ => self.inner.default.clone(),
        };
        proxy.handle(req, Some(conn.peer)).await
    }

    /// Whether a request carries this proxy's own `Via` entry: its own forwarded request was
    /// intercepted and sent back to it.
    fn came_back(&self, req: &Request<Body>) -> bool {
        let own = self.inner.via.as_bytes();
        req.headers()
            .get_all(http::header::VIA)
            .iter()
            .any(|v| v.as_bytes().windows(own.len()).any(|w| w == own))
    }

    /// The proxy for one original destination, or the error code and message to answer.
    fn for_dst(&self, dst: Destination) -> Result<Proxy, (&'static str, String)> {
        let mut cache = match self.inner.by_dst.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let now = Instant::now();
        if let Some(e) = cache.live.get_mut(&dst) {
            e.used = now;
            return Ok(e.proxy.clone());
        }
        cache.make_room(now, Proxy::is_idle);
        let mut upstream = self
            .inner
            .factory
            .upstream(&format!("http://{}", dst.addr))
            .map_err(|e| ("upstream_unavailable", e))?
            .with_via(self.inner.via.clone());
        if let Some(host) = &dst.host {
            upstream = upstream.with_host(host.clone());
        }
        tracing::info!(dst = %dst.addr, host = ?dst.host, "forwarding intercepted connections to their original destination");
        // The destination (address and the agent's Host) names the store its documents live in.
        let store = format!(
            "{} {}",
            dst.addr,
            dst.host.as_ref().and_then(|h| h.to_str().ok()).unwrap_or("")
        );
        let proxy = self.inner.factory.proxy_for_store(upstream, &store);
        cache.live.insert(
            dst,
            Entry {
                proxy: proxy.clone(),
                used: now,
            },
        );
        Ok(proxy)
    }

    /// Waits until no write is in flight in any pipeline.
    pub async fn drain(&self) {
        let mut all = vec![self.inner.default.clone()];
        {
            let cache = match self.inner.by_dst.lock() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            all.extend(cache.live.values().map(|e| e.proxy.clone()));
            all.extend(cache.retired.iter().cloned());
        }
        for proxy in all {
            proxy.pipeline().drain().await;
        }
    }
}

/// The agent-facing service of one connection (see [`Destinations::for_connection`]).
#[derive(Clone)]
pub struct ConnService {
    destinations: Destinations,
    conn: Conn,
    /// The proxy every request of this connection goes to, when it was not intercepted.
    fixed: Option<Proxy>,
}

impl<B> tower::Service<Request<B>> for ConnService
where
    B: http_body::Body<Data = bytes::Bytes> + Send + Sync + 'static,
    B::Error: Into<crate::http::BoxError>,
{
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = futures_util::future::BoxFuture<'static, Result<Response<Body>, Self::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let this = self.clone();
        let req = req.map(crate::http::boxed);
        Box::pin(async move {
            Ok(match &this.fixed {
                Some(proxy) => proxy.handle(req, Some(this.conn.peer)).await,
                None => this.destinations.handle(req, this.conn).await,
            })
        })
    }
}

// === impl Cache ===

impl<P> Cache<P> {
    /// Drops destinations unused for [`DESTINATION_IDLE`], then the least recently used ones
    /// while [`MAX_DESTINATIONS`] are kept; forgets retired ones `is_idle` says are done.
    fn make_room(&mut self, now: Instant, is_idle: impl Fn(&P) -> bool) {
        let expired: Vec<Destination> = self
            .live
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.used) >= DESTINATION_IDLE)
            .map(|(dst, _)| dst.clone())
            .collect();
        for dst in expired {
            self.retire(dst);
        }
        while self.live.len() >= MAX_DESTINATIONS {
            let Some(oldest) = self.live.iter().min_by_key(|(_, e)| e.used).map(|(dst, _)| dst.clone()) else {
                break;
            };
            self.retire(oldest);
        }
        self.retired.retain(|p| !is_idle(p));
    }

    fn retire(&mut self, dst: Destination) {
        if let Some(e) = self.live.remove(&dst) {
            tracing::debug!(dst = %dst.addr, host = ?dst.host, "destination dropped from the cache");
            self.retired.push(e.proxy);
        }
    }
}

/// The answer to a request that looped back: said loudly in the log, once per request, and
/// to the client, instead of forwarding again until descriptors run out.
fn forwarding_loop(dst: SocketAddr) -> Response<Body> {
    tracing::error!(
        %dst,
        "the sidecar's own connections are being intercepted and sent back to it: run it as the \
         user id excluded by `turnlock init-iptables --proxy-uid`"
    );
    EdgeError::ForwardingLoop(dst).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(ports: &[u16]) -> InitIptablesArgs {
        InitIptablesArgs {
            store_ports: ports.to_vec(),
            proxy_port: 7070,
            proxy_uid: 1337,
            dry_run: true,
            iptables: "iptables".into(),
            iptables_restore: "iptables-restore".into(),
            ipv6: Ipv6Rules::Auto,
            ip6tables: "ip6tables".into(),
            ip6tables_restore: "ip6tables-restore".into(),
        }
    }

    #[test]
    fn rules_redirect_store_ports_except_the_proxy_user() {
        let rules = nat_rules(&args(&[8080, 9000]));
        let lines: Vec<&str> = rules.lines().collect();
        assert_eq!(lines.first(), Some(&"*nat"));
        assert_eq!(lines.last(), Some(&"COMMIT"));
        let uid = lines
            .iter()
            .position(|l| l.contains("--uid-owner 1337 -j RETURN"))
            .expect("uid exclusion");
        let redirect = lines
            .iter()
            .position(|l| l.contains("--dports 8080,9000 -j TURNLOCK_REDIRECT"))
            .expect("port match");
        assert!(uid < redirect, "the proxy's own traffic must be excluded first");
        assert!(rules.contains("-j REDIRECT --to-ports 7070"));
        assert!(rules.contains("-A OUTPUT -p tcp -j TURNLOCK_OUTPUT"));
    }

    fn dst(i: usize) -> Destination {
        Destination {
            addr: SocketAddr::from(([198, 18, (i / 250) as u8, (i % 250) as u8], 8080)),
            host: None,
        }
    }

    #[test]
    fn the_destination_cache_drops_the_least_recently_used_and_the_idle() {
        let mut cache: Cache<usize> = Cache::default();
        let start = Instant::now();
        for i in 0..200 {
            let now = start + Duration::from_millis(i as u64);
            // Destination 0 stays in use all along.
            if let Some(e) = cache.live.get_mut(&dst(0)) {
                e.used = now;
            }
            cache.make_room(now, |_| false);
            cache.live.insert(dst(i), Entry { proxy: i, used: now });
            assert!(cache.live.len() <= MAX_DESTINATIONS);
        }
        assert!(cache.live.contains_key(&dst(0)), "the destination in use was dropped");
        assert!(cache.live.contains_key(&dst(199)));
        assert!(!cache.live.contains_key(&dst(1)), "the least recently used was kept");
        assert_eq!(cache.retired.len(), 200 - MAX_DESTINATIONS);
        // Retired proxies are forgotten once idle; unused destinations expire.
        let later = start + DESTINATION_IDLE + Duration::from_secs(1);
        cache.make_room(later, |_| true);
        assert!(cache.retired.is_empty());
        assert!(
            cache.live.is_empty(),
            "{} destinations outlived their idle time",
            cache.live.len()
        );
    }

    #[test]
    fn proxy_port_cannot_be_intercepted() {
        assert!(args(&[7070]).validate().is_err());
        assert!(args(&[]).validate().is_err());
        assert!(args(&[0]).validate().is_err());
        assert!(args(&[1; 16]).validate().is_err());
        assert!(args(&[8080]).validate().is_ok());
    }
}
