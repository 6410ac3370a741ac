//! Prometheus metrics: every lock point is visible (wait, outcome, hold, renewals), plus
//! stale rejections, idempotent replays, coalescing, upstream latency and requests.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteStatus {
    route: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Op {
    op: &'static str,
}

/// Cheap to clone; all clones feed one registry.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    lock_wait: Histogram,
    lock_acquire: Family<Outcome, Counter>,
    lock_hold: Histogram,
    lock_renewals: Family<Outcome, Counter>,
    stale: Counter,
    replays: Counter,
    batch_size: Histogram,
    upstream: Family<Op, Histogram>,
    requests: Family<RouteStatus, Counter>,
}

fn seconds_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.000_05, 2.0, 16)
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("turnlock");
        let lock_wait = Histogram::new(seconds_buckets());
        registry.register(
            "lock_wait_seconds",
            "Time spent obtaining a session lock",
            lock_wait.clone(),
        );
        let lock_acquire = Family::<Outcome, Counter>::default();
        registry.register(
            "lock_acquire",
            "Lock acquisitions by outcome (acquired, busy, error)",
            lock_acquire.clone(),
        );
        let lock_hold = Histogram::new(seconds_buckets());
        registry.register("lock_hold_seconds", "Time a session lock was held", lock_hold.clone());
        let lock_renewals = Family::<Outcome, Counter>::default();
        registry.register(
            "lock_renewals",
            "Lease renewals by outcome (renewed, failed)",
            lock_renewals.clone(),
        );
        let stale = Counter::default();
        registry.register(
            "stale_rejections",
            "Writes refused because their turn was older than the stored turn",
            stale.clone(),
        );
        let replays = Counter::default();
        registry.register(
            "idempotent_replays",
            "Retried requests answered from their idempotency record",
            replays.clone(),
        );
        let batch_size = Histogram::new(exponential_buckets(1.0, 2.0, 9));
        registry.register(
            "write_batch_size",
            "Writes merged into one read-merge-write (coalescing)",
            batch_size.clone(),
        );
        let upstream = Family::<Op, Histogram>::new_with_constructor(|| Histogram::new(seconds_buckets()));
        registry.register(
            "upstream_request_seconds",
            "Upstream request latency by operation",
            upstream.clone(),
        );
        let requests = Family::<RouteStatus, Counter>::default();
        registry.register("requests", "Agent requests by route and status", requests.clone());
        Self {
            inner: Arc::new(Inner {
                registry,
                lock_wait,
                lock_acquire,
                lock_hold,
                lock_renewals,
                stale,
                replays,
                batch_size,
                upstream,
                requests,
            }),
        }
    }

    pub fn lock_acquired(&self, outcome: &'static str, waited: Duration) {
        self.inner.lock_acquire.get_or_create(&Outcome { outcome }).inc();
        self.inner.lock_wait.observe(waited.as_secs_f64());
    }

    pub fn lock_held(&self, held: Duration) {
        self.inner.lock_hold.observe(held.as_secs_f64());
    }

    pub fn lock_renewed(&self, ok: bool) {
        let outcome = if ok { "renewed" } else { "failed" };
        self.inner.lock_renewals.get_or_create(&Outcome { outcome }).inc();
    }

    pub fn stale_rejected(&self) {
        self.inner.stale.inc();
    }

    pub fn idempotent_replay(&self) {
        self.inner.replays.inc();
    }

    pub fn batch(&self, size: usize) {
        self.inner.batch_size.observe(size as f64);
    }

    pub fn upstream(&self, op: &'static str, took: Duration) {
        self.inner
            .upstream
            .get_or_create(&Op { op })
            .observe(took.as_secs_f64());
    }

    pub fn request(&self, route: &'static str, status: u16) {
        self.inner.requests.get_or_create(&RouteStatus { route, status }).inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.inner.registry).is_err() {
            out.clear();
        }
        out
    }
}
