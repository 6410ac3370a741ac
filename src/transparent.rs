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

use clap::Args;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::config::ConfigError;
use crate::http::{error, Body};
use crate::proxy::Proxy;
use crate::server::Conn;
use crate::sidecar::ProxyFactory;

/// The nat chain holding turnlock's rules (jumped to from `OUTPUT`).
pub const OUTPUT_CHAIN: &str = "TURNLOCK_OUTPUT";
/// The nat chain that redirects into the sidecar.
pub const REDIRECT_CHAIN: &str = "TURNLOCK_REDIRECT";
/// Most distinct original destinations one proxy forwards to (each gets its own pool and
/// write pipeline); connections to further ones are refused with 502.
pub const MAX_DESTINATIONS: usize = 64;
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

/// Installs the rules (or prints them with `--dry-run`).
pub async fn run_init_iptables(args: InitIptablesArgs) -> Result<ExitCode, ConfigError> {
    args.validate()?;
    let rules = nat_rules(&args);
    if args.dry_run {
        print!("{rules}");
        return Ok(ExitCode::SUCCESS);
    }
    // A rerun (an init container restarted in the same network namespace) must not add a
    // second jump; the chains themselves are emptied by the restore.
    let _ = tokio::process::Command::new(&args.iptables)
        .args(["-t", "nat", "-D", "OUTPUT", "-p", "tcp", "-j", OUTPUT_CHAIN])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    let mut child = tokio::process::Command::new(&args.iptables_restore)
        .arg("--noflush")
        .stdin(Stdio::piped())
        .spawn()
        .map_err(|e| ConfigError(format!("cannot run {}: {e}", args.iptables_restore)))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(rules.as_bytes())
            .await
            .map_err(|e| ConfigError(format!("cannot write to {}: {e}", args.iptables_restore)))?;
    }
    let status = child
        .wait()
        .await
        .map_err(|e| ConfigError(format!("{} failed: {e}", args.iptables_restore)))?;
    if !status.success() {
        eprintln!(
            "turnlock: {} exited with {status}; rules were:\n{rules}",
            args.iptables_restore
        );
        return Ok(ExitCode::FAILURE);
    }
    tracing::info!(
        ports = ?args.store_ports,
        proxy_port = args.proxy_port,
        proxy_uid = args.proxy_uid,
        "outbound store traffic now goes through the sidecar"
    );
    Ok(ExitCode::SUCCESS)
}

/// The destination a connection had before a nat REDIRECT rule sent it here, if any.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn original_dst(stream: &TcpStream) -> Option<SocketAddr> {
    let sock = socket2::SockRef::from(stream);
    let found = match stream.local_addr().ok()? {
        SocketAddr::V4(_) => sock.original_dst_v4(),
        SocketAddr::V6(_) => sock.original_dst_v6(),
    };
    found.ok()?.as_socket()
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub fn original_dst(_stream: &TcpStream) -> Option<SocketAddr> {
    None
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
    by_dst: Mutex<HashMap<SocketAddr, Proxy>>,
}

// === impl Destinations ===

impl Destinations {
    pub(crate) fn new(factory: ProxyFactory, default: Proxy, own: SocketAddr) -> Self {
        Self {
            inner: Arc::new(Inner {
                factory,
                default,
                own,
                by_dst: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub async fn handle(&self, req: Request<Incoming>, conn: Conn) -> Response<Body> {
        let proxy = match conn.original_dst {
            Some(dst) if !self.is_own(dst) => match self.for_dst(dst) {
                Ok(p) => p,
                Err((code, message)) => return error(StatusCode::BAD_GATEWAY, code, message, None),
            },
            _ => self.inner.default.clone(),
        };
        proxy.handle(req, conn.peer).await
    }

    /// A connection made to the proxy's own address was not redirected: it uses `--upstream`.
    fn is_own(&self, dst: SocketAddr) -> bool {
        let own = self.inner.own;
        dst == own || (dst.port() == own.port() && (own.ip().is_unspecified() || dst.ip().is_loopback()))
    }

    /// The proxy for one original destination, or the error code and message to answer.
    fn for_dst(&self, dst: SocketAddr) -> Result<Proxy, (&'static str, String)> {
        let mut by_dst = match self.inner.by_dst.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(p) = by_dst.get(&dst) {
            return Ok(p.clone());
        }
        if by_dst.len() >= MAX_DESTINATIONS {
            return Err((
                "too_many_destinations",
                format!("this proxy already forwards to {MAX_DESTINATIONS} stores"),
            ));
        }
        let upstream = self
            .inner
            .factory
            .upstream(&format!("http://{dst}"))
            .map_err(|e| ("upstream_unavailable", e))?;
        tracing::info!(%dst, "forwarding intercepted connections to their original destination");
        let proxy = self.inner.factory.proxy(upstream);
        by_dst.insert(dst, proxy.clone());
        Ok(proxy)
    }

    /// Waits until no write is in flight in any pipeline.
    pub async fn drain(&self) {
        let mut all = vec![self.inner.default.clone()];
        {
            let by_dst = match self.inner.by_dst.lock() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            all.extend(by_dst.values().cloned());
        }
        for proxy in all {
            proxy.pipeline().drain().await;
        }
    }
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

    #[test]
    fn proxy_port_cannot_be_intercepted() {
        assert!(args(&[7070]).validate().is_err());
        assert!(args(&[]).validate().is_err());
        assert!(args(&[0]).validate().is_err());
        assert!(args(&[1; 16]).validate().is_err());
        assert!(args(&[8080]).validate().is_ok());
    }
}
