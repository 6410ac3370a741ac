//! `turnlock inject`: the Kubernetes mutating admission webhook that adds the turnlock sidecar
//! to agent pods, the way Istio's and Dapr's injectors do.
//!
//! - [`annotations`]: what a pod asks for (opt-in / opt-out, per-pod overrides).
//! - [`pod`]: the decision and the mutation of the pod (pure), producing a JSON Patch.
//! - [`review`]: `admission.k8s.io/v1` AdmissionReview in and out.
//! - [`server`]: the HTTPS server (certificates reloaded when the mounted files change).
//! - [`certs`]: `turnlock inject certs`, a CA and serving certificate for local clusters.

pub mod annotations;
pub mod certs;
pub mod pod;
pub mod review;
pub mod server;

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Subcommand};

/// The name of the injected sidecar container.
pub const SIDECAR_NAME: &str = "turnlock";
/// The name of the injected init container that installs the interception rules.
pub const INIT_NAME: &str = "turnlock-init";

#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct InjectArgs {
    #[command(subcommand)]
    pub command: Option<InjectCommand>,
    #[command(flatten)]
    pub webhook: WebhookArgs,
}

#[derive(Debug, Clone, Subcommand)]
pub enum InjectCommand {
    /// Generate a CA and the webhook's serving certificate (for kind and other local clusters;
    /// use cert-manager in real ones).
    Certs(certs::CertsArgs),
}

/// The webhook server and the cluster-wide defaults of the injected sidecar (each can be
/// overridden per pod by an annotation, see [`annotations`]).
#[derive(Debug, Clone, Args)]
pub struct WebhookArgs {
    /// HTTPS address the API server calls.
    #[arg(long, env = "TURNLOCK_INJECT_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,
    /// PEM certificate chain (as mounted from the cert-manager secret).
    #[arg(long, env = "TURNLOCK_TLS_CERT", default_value = "/etc/turnlock/tls/tls.crt")]
    pub tls_cert: PathBuf,
    /// PEM private key.
    #[arg(long, env = "TURNLOCK_TLS_KEY", default_value = "/etc/turnlock/tls/tls.key")]
    pub tls_key: PathBuf,
    /// How often the certificate files are checked for a renewal, in seconds.
    #[arg(long, env = "TURNLOCK_TLS_RELOAD_SECS", default_value_t = 10)]
    pub tls_reload_secs: u64,
    /// The sidecar image.
    #[arg(long, env = "TURNLOCK_SIDECAR_IMAGE", default_value = concat!("turnlock:", env!("CARGO_PKG_VERSION")))]
    pub image: String,
    /// Inject as a native sidecar (an init container with `restartPolicy: Always`; Kubernetes
    /// 1.29+) unless a pod's annotation says otherwise.
    #[arg(long, env = "TURNLOCK_NATIVE_SIDECAR")]
    pub native_sidecar: bool,
    /// The store URL the sidecar forwards to, for pods without the upstream annotation.
    #[arg(long, env = "TURNLOCK_DEFAULT_UPSTREAM")]
    pub upstream: Option<String>,
    /// The Redis URL given to sidecars, for pods without a Redis annotation.
    #[arg(long, env = "TURNLOCK_DEFAULT_REDIS")]
    pub redis: Option<String>,
    /// A Secret holding the Redis URL, as `<name>/<key>` (takes precedence over `--redis`).
    #[arg(long, env = "TURNLOCK_DEFAULT_REDIS_SECRET")]
    pub redis_secret: Option<String>,
    /// The agent's environment variable set to the sidecar's address, for pods without the
    /// store-url-env annotation.
    #[arg(long, env = "TURNLOCK_DEFAULT_STORE_URL_ENV")]
    pub store_url_env: Option<String>,
    /// Port the sidecar serves the agent on (loopback).
    #[arg(long, env = "TURNLOCK_PROXY_PORT", default_value_t = 7070)]
    pub proxy_port: u16,
    /// Port of the sidecar's admin server (probes and metrics).
    #[arg(long, env = "TURNLOCK_ADMIN_PORT", default_value_t = 9901)]
    pub admin_port: u16,
    /// The sidecar's user id (excluded from interception in transparent mode).
    #[arg(long, env = "TURNLOCK_PROXY_UID", default_value_t = 1337)]
    pub proxy_uid: i64,
    #[arg(long, env = "TURNLOCK_SIDECAR_CPU_REQUEST", default_value = "50m")]
    pub cpu_request: String,
    #[arg(long, env = "TURNLOCK_SIDECAR_MEMORY_REQUEST", default_value = "32Mi")]
    pub memory_request: String,
    /// The sidecar's CPU limit; empty (the default) sets none, so a burst of writes is not
    /// throttled by the CFS quota while the request still reserves its share.
    #[arg(long, env = "TURNLOCK_SIDECAR_CPU_LIMIT", default_value = "")]
    pub cpu_limit: String,
    #[arg(long, env = "TURNLOCK_SIDECAR_MEMORY_LIMIT", default_value = "128Mi")]
    pub memory_limit: String,
    /// The sidecar's log level (`RUST_LOG`).
    #[arg(long, env = "TURNLOCK_SIDECAR_LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    /// After SIGTERM, how long the webhook keeps answering reviews (with `/readyz` at 503, so
    /// the Service stops sending it new ones) before it closes its listener, in milliseconds.
    #[arg(long, env = "TURNLOCK_INJECT_DRAIN_MS", default_value_t = 5000)]
    pub drain_ms: u64,
}

impl WebhookArgs {
    /// Defaults for tests: loopback on a free port, certificates given by the caller.
    pub fn local(tls_cert: PathBuf, tls_key: PathBuf) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            tls_cert,
            tls_key,
            tls_reload_secs: 10,
            image: concat!("turnlock:", env!("CARGO_PKG_VERSION")).into(),
            native_sidecar: false,
            upstream: None,
            redis: None,
            redis_secret: None,
            store_url_env: None,
            proxy_port: 7070,
            admin_port: 9901,
            proxy_uid: 1337,
            cpu_request: "50m".into(),
            memory_request: "32Mi".into(),
            cpu_limit: String::new(),
            memory_limit: "128Mi".into(),
            log_level: "info".into(),
            drain_ms: 0,
        }
    }
}

/// Runs `turnlock inject` (the webhook until a signal cancels `shutdown`) or `inject certs`.
pub async fn run(
    args: InjectArgs,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), crate::config::StartError> {
    match args.command {
        Some(InjectCommand::Certs(c)) => Ok(certs::run(&c)?),
        None => {
            let running = server::start(args.webhook).await?;
            let token = running.shutdown_token();
            tokio::spawn(async move {
                shutdown.cancelled().await;
                token.cancel();
            });
            running.wait().await;
            Ok(())
        }
    }
}
