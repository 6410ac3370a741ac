//! Dependency health, checked in the background: probes read it, they never wait on Redis or
//! the store. Readiness means "this sidecar can serve" (its listeners are up and it is not
//! shutting down); a Redis or store outage is shown by `/status`, the `dependency_up` gauge
//! and one log line per change, while reads keep flowing and writes fail fast with
//! `lock_unavailable` or `upstream_unavailable`.
//!
//! On a Redis Cluster the check reads the slot layout from any node and asks every primary
//! for `CLUSTER INFO`: Redis counts as down while any primary does not answer or says
//! `cluster_state:fail`, and `/status` lists each primary (`nodes`, `degraded` while some
//! shards work and others do not). Readiness stays the latch above: one shard down leaves the
//! sessions of the other shards writable, and a Redis outage must not take every agent pod
//! out of its Service.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::lock::Locks;
use crate::metrics::Metrics;
use crate::redis_conn::{ClusterHealth, NodeHealth};
use crate::upstream::Upstream;

/// How often each dependency is checked.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long one check may take before the dependency counts as down.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// Cheap to clone; all clones share one state.
#[derive(Clone)]
pub struct Health {
    inner: Arc<Inner>,
}

struct Inner {
    redis: Dependency,
    /// On a Redis Cluster, each primary's last check (empty otherwise).
    redis_nodes: Mutex<Vec<NodeHealth>>,
    /// `None` in transparent mode, where there is no single store to check.
    store: Option<Dependency>,
    shutdown: CancellationToken,
}

/// One dependency's last known state.
struct Dependency {
    name: &'static str,
    checked: AtomicBool,
    up: AtomicBool,
    state: Mutex<DepState>,
}

#[derive(Default)]
struct DepState {
    /// Unix seconds of the last change of `up`.
    since: u64,
    error: Option<String>,
}

// === impl Health ===

impl Health {
    pub fn new(with_store: bool, shutdown: CancellationToken) -> Self {
        Self {
            inner: Arc::new(Inner {
                redis: Dependency::new("redis"),
                redis_nodes: Mutex::new(Vec::new()),
                store: with_store.then(|| Dependency::new("store")),
                shutdown,
            }),
        }
    }

    /// Whether this sidecar can serve: no I/O, only whether it is shutting down.
    pub fn ready(&self) -> bool {
        !self.inner.shutdown.is_cancelled()
    }

    /// Whether Redis answered its last check (true before the first check).
    pub fn redis_up(&self) -> bool {
        !self.inner.redis.checked.load(Ordering::Acquire) || self.inner.redis.up.load(Ordering::Acquire)
    }

    /// Why each dependency that failed its last check is down (`/readyz` shows it; readiness
    /// itself does not depend on it).
    pub fn down(&self) -> serde_json::Map<String, Value> {
        let mut down = serde_json::Map::new();
        for dep in std::iter::once(&self.inner.redis).chain(self.inner.store.as_ref()) {
            if dep.checked.load(Ordering::Acquire) && !dep.up.load(Ordering::Acquire) {
                let state = dep.state.lock().unwrap_or_else(|p| p.into_inner());
                down.insert(dep.name.into(), state.error.clone().map_or(Value::Null, Value::String));
            }
        }
        down
    }

    /// The detailed status for `/status` and `turnlock health --deps`.
    pub fn status(&self) -> Value {
        let mut deps = serde_json::Map::new();
        let mut redis = self.inner.redis.describe();
        let nodes = self.inner.redis_nodes.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if !nodes.is_empty() {
            // A cluster: which primaries answer. With some up and some down the proxy is
            // degraded: the sessions of the shards up are written, the others' writes fail.
            let up = nodes.iter().filter(|n| n.up).count();
            redis["degraded"] = json!(up > 0 && up < nodes.len());
            redis["nodes"] = serde_json::to_value(&nodes).unwrap_or(Value::Null);
        }
        deps.insert("redis".into(), redis);
        if let Some(store) = &self.inner.store {
            deps.insert("store".into(), store.describe());
        }
        json!({
            "ready": self.ready(),
            "shutting_down": self.inner.shutdown.is_cancelled(),
            "dependencies": deps,
        })
    }

    /// Checks every dependency every [`CHECK_EVERY`] until `stop` fires.
    pub fn spawn_checks(&self, locks: Locks, upstream: Option<Upstream>, metrics: Metrics, stop: CancellationToken) {
        let health = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(CHECK_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let redis = async {
                    // On a cluster each primary is checked (half the time for the layout,
                    // half for the primaries); elsewhere one PING.
                    match tokio::time::timeout(CHECK_TIMEOUT, locks.cluster_health(CHECK_TIMEOUT / 2)).await {
                        Ok(Some(Ok(cluster))) => {
                            health.record_nodes(&cluster, &metrics);
                            if cluster.all_up() {
                                Ok(())
                            } else {
                                Err(cluster.summary())
                            }
                        }
                        Ok(Some(Err(e))) => Err(e.to_string()),
                        Ok(None) => match tokio::time::timeout(CHECK_TIMEOUT, locks.ping()).await {
                            Ok(Ok(())) => Ok(()),
                            Ok(Err(e)) => Err(e.to_string()),
                            Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
                        },
                        Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
                    }
                };
                let store = async {
                    match &upstream {
                        None => Ok(()),
                        Some(u) => match tokio::time::timeout(CHECK_TIMEOUT, u.ping()).await {
                            Ok(Ok(())) => Ok(()),
                            Ok(Err(e)) => Err(format!("the store did not answer: {e}")),
                            Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
                        },
                    }
                };
                let (redis, store) = tokio::join!(redis, store);
                health.inner.redis.record(redis, &metrics);
                if let Some(dep) = &health.inner.store {
                    dep.record(store, &metrics);
                }
            }
        });
    }
}

impl Health {
    /// Stores each cluster primary's check, logs each change by node, and sets its gauge.
    fn record_nodes(&self, cluster: &ClusterHealth, metrics: &Metrics) {
        let mut nodes = self.inner.redis_nodes.lock().unwrap_or_else(|p| p.into_inner());
        for n in &cluster.nodes {
            metrics.redis_node(&n.node, n.up);
            let was = nodes.iter().find(|o| o.node == n.node).map(|o| o.up);
            match (was, n.up) {
                (Some(true) | None, false) => tracing::warn!(
                    node = %n.node,
                    slots = %n.slots.join(","),
                    state = n.state.as_deref().unwrap_or("-"),
                    error = n.error.as_deref().unwrap_or("-"),
                    "Redis Cluster primary down: writes to its sessions fail until it or its replica answers"
                ),
                (Some(false), true) => tracing::info!(node = %n.node, "Redis Cluster primary answers again"),
                (None, true) => tracing::info!(node = %n.node, slots = %n.slots.join(","), "Redis Cluster primary"),
                _ => {}
            }
        }
        for gone in nodes.iter().filter(|o| !cluster.nodes.iter().any(|n| n.node == o.node)) {
            metrics.forget_redis_node(&gone.node);
            tracing::info!(node = %gone.node, "no longer a Redis Cluster primary");
        }
        *nodes = cluster.nodes.clone();
    }
}

// === impl Dependency ===

impl Dependency {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            checked: AtomicBool::new(false),
            up: AtomicBool::new(false),
            state: Mutex::new(DepState::default()),
        }
    }

    /// Stores one check's result; logs only changes (so an outage is one WARN, not one per
    /// second).
    fn record(&self, result: Result<(), String>, metrics: &Metrics) {
        let up = result.is_ok();
        let first = !self.checked.swap(true, Ordering::AcqRel);
        let was = self.up.swap(up, Ordering::AcqRel);
        metrics.dependency_up(self.name, up);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if first || was != up {
            state.since = unix_now();
            match (&result, first) {
                (Ok(()), true) => tracing::info!(dependency = self.name, "dependency reachable"),
                (Ok(()), false) => tracing::info!(dependency = self.name, "dependency recovered"),
                (Err(error), _) => tracing::warn!(
                    dependency = self.name,
                    %error,
                    "dependency unreachable: writes fail fast until it is back; reads still pass through"
                ),
            }
        }
        state.error = result.err();
    }

    fn describe(&self) -> Value {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let checked = self.checked.load(Ordering::Acquire);
        json!({
            "up": checked.then(|| self.up.load(Ordering::Acquire)),
            "since_unix": checked.then_some(state.since),
            "error": state.error,
        })
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
