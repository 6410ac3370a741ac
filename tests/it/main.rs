//! turnlock's integration tests, in one binary: real `redis-server` processes, real sockets,
//! in-process proxies and stores, and `turnlock` processes. One module per area; the harness
//! they share is in `support`.
//!
//! Run one area with `cargo test --test it <module>::`, e.g. `cargo test --test it faults::`.
//! `transparent_netns` needs root (it fails, never skips, without it); `soak` runs for
//! `TURNLOCK_SOAK_SECS` (default 120 s).

mod support;

mod agent_frameworks;
mod api;
mod cli;
mod cluster;
mod coalescing;
mod commit_order;
mod commit_round_trips;
mod connection_close;
mod contention;
mod deploy_metrics;
mod edges;
mod fair_order;
mod faults;
mod faults_failover;
mod fuzz_props;
mod hostile_input;
mod idle_connections;
mod inject_webhook;
mod operability;
mod passthrough;
mod proxy_service;
mod real_stores;
mod redis_restart;
mod redis_tls;
mod release_records;
mod route_matching;
mod soak;
mod store_answers;
mod store_edges;
mod store_misbehaviour;
mod tls_store;
mod transparent_netns;
mod weak_store;
mod web_identity;
mod write_back;
