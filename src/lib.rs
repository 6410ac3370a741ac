//! turnlock: a per-pod sidecar that makes AI-agent session-context writes safe when several
//! replicas serve the same session.
//!
//! Map of the crate:
//! - [`session`]: session ids, turns, the stale rule and the Redis keys (pure).
//! - [`merge`]: how each kind of write changes a session document (pure), one file per
//!   operation.
//! - [`routes`]: which requests are writes and how each is handled; the store dialects.
//! - [`lock`]: the session lock (Redis or in-memory): grant, fencing token, renewal, release,
//!   and the version fence for stores without ETags.
//! - [`records`]: expiring records (idempotency results, version snapshots).
//! - [`upstream`]: the HTTP client to the context store (TLS, SigV4 signing).
//! - [`proxy`]: the agent-facing service: its tower layers (catch-panic, trace, request
//!   metrics), request parsing, the write pipeline (idempotency, coalescing queue, merge and
//!   forward commits), the error map, and pass-through forwarding.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/status`.
//! - [`health`]: dependency health checked in the background (probes never wait on it).
//! - [`sidecar`]: assembling and running the proxy, with graceful shutdown.
//! - [`server`]: the accept loop and tower stack every server runs on, its drain, and
//!   accepting intercepted connections (original destination, raw TCP).
//! - [`transparent`]: `init-iptables` and a proxy per original destination, for agents whose
//!   store URL cannot be changed.
//! - [`inject`]: the Kubernetes sidecar-injection webhook and its certificates.
//! - [`store`]: the reference context store.
//! - [`demo`]: lost updates without turnlock, none with it.
//! - [`bench`]: turnlock measured side by side with the store alone and with naive locks.
//! - [`config`]: the proxy's flags, start errors and exit codes (each other subcommand's
//!   arguments live with its module).
//! - [`key_layout`]: the startup check for keys of the older layout, and `migrate-keys`.
//! - [`redis_url`]: the Redis URL forms, checked alike by the proxy and the injector.
//! - [`redis_tls`]: TLS to Redis (roots, client certificate, server name), files reloaded.
//! - [`http`], [`metrics`], [`redis_conn`], [`client`], [`telemetry`]: the plumbing.
//!
//! Top-level modules use each other without a cycle (checked by a unit test).

pub mod admin;
pub mod bench;
pub mod client;
pub mod config;
pub mod demo;
pub mod health;
pub mod http;
pub mod inject;
pub mod key_layout;
pub mod lock;
pub mod merge;
pub mod metrics;
pub mod proxy;
pub mod records;
pub mod redis_conn;
pub mod redis_tls;
pub mod redis_url;
pub mod routes;
pub mod server;
pub mod session;
pub mod sidecar;
pub mod store;
pub mod telemetry;
pub mod transparent;
pub mod upstream;

#[cfg(test)]
mod layering;
