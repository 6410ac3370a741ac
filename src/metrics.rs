//! Prometheus metrics: every lock point is visible (wait, outcome, hold, renewals), plus
//! stale rejections, idempotent replays, coalescing, upstream latency and answers, requests
//! by route, status and error code, writes in flight, dependency health, Redis errors, the
//! process (memory, descriptors, CPU) and the build.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
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
    /// The answer's error code (one of [`ERROR_CODES`], `other`), empty on success.
    error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpStatus {
    op: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DependencyLabel {
    dependency: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabel {
    node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RedisFailure {
    op: &'static str,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Build {
    version: &'static str,
}

/// Every error code an agent can be answered with: the bounded values of the `error` label.
pub const ERROR_CODES: &[&str] = &[
    "ambiguous_path",
    "body_read_failed",
    "body_timeout",
    "body_too_large",
    "bulk_as_given",
    "conflict",
    "document_too_large",
    "fenced_out",
    "forbidden_field",
    "forwarding_loop",
    "head_timeout",
    "head_too_large",
    "idempotency_key_reused",
    "idempotency_record_unreadable",
    "internal",
    "invalid_body",
    "invalid_host",
    "invalid_idempotency_key",
    "invalid_if_match",
    "invalid_messages",
    "invalid_path",
    "invalid_session_id",
    "invalid_through",
    "invalid_turn",
    "invalid_version",
    "invalid_wait_deadline",
    "lease_lost",
    "lock_unavailable",
    "malformed_json",
    "malformed_request",
    "method_not_allowed",
    "method_not_supported",
    "method_override",
    "missing_turn",
    "not_found",
    "nothing_to_match",
    "precondition_required",
    "request_in_progress",
    "session_busy",
    "session_not_found",
    "stale_turn",
    "too_many_destinations",
    "turn_mismatch",
    "unknown_field",
    "unknown_message",
    "unlocked_write_refused",
    "unsupported_charset",
    "unsupported_content_encoding",
    "unsupported_media_type",
    "unsupported_transfer_coding",
    "upstream_conflict",
    "upstream_error",
    "upstream_invalid_document",
    "upstream_timeout",
    "upstream_unavailable",
    "uri_too_long",
    "version_mismatch",
    "versions_disagree",
    "write_conflict",
];

/// The error code of an answer, carried as a response extension so the request counter can
/// label it without reading the body.
#[derive(Clone, Copy, Debug)]
pub struct ErrorCode(pub &'static str);

/// The route that answered a request (the `route` label of `turnlock_requests_total`), put
/// into the answer's extensions; an answer without it was forwarded (route `forward`: a
/// forwarded answer carries no extension, which would cost a map per request).
#[derive(Clone, Copy, Debug)]
pub struct RouteName(pub &'static str);

/// The `error` label for a code: itself when known, `other` otherwise (labels stay bounded).
pub fn error_label(code: &str) -> &'static str {
    ERROR_CODES.iter().find(|c| **c == code).copied().unwrap_or("other")
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
    requeued: Counter,
    replays: Counter,
    batch_size: Histogram,
    upstream: Family<Op, Histogram>,
    upstream_responses: Family<OpStatus, Counter>,
    upstream_retries: Counter,
    requests: Family<RouteStatus, Counter>,
    /// The counters of the commonest answers, by status, looked up once: a request passed
    /// through successfully (route `forward`), and the store's answer to it.
    forwarded: StatusCounters,
    store_forwarded: StatusCounters,
    writes_in_flight: Gauge,
    dependency_up: Family<DependencyLabel, Gauge>,
    redis_errors: Family<RedisFailure, Counter>,
    redis_node_up: Family<NodeLabel, Gauge>,
    redis_node_check_failures: Family<NodeLabel, Counter>,
    process: Process,
    write_seconds: Histogram,
    redis_restarts: Counter,
}

/// A counter per HTTP status, each taken from its family at its first use.
struct StatusCounters(Box<[std::sync::OnceLock<Counter>]>);

impl StatusCounters {
    fn new() -> Self {
        Self((0..600).map(|_| std::sync::OnceLock::new()).collect())
    }

    /// The counter of `status`, or `None` for a status outside 0–599.
    fn get(&self, status: u16, make: impl FnOnce() -> Counter) -> Option<&Counter> {
        self.0.get(usize::from(status)).map(|c| c.get_or_init(make))
    }
}

/// Gauges of the process itself, refreshed at each scrape from `/proc/self`.
struct Process {
    resident: Gauge,
    fds: Gauge,
    cpu_ms: Counter,
}

/// 100 µs to 13 s: past the default lease (2 s) and store timeout (5 s).
fn seconds_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.000_1, 2.0, 18)
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
        // Every outcome is exposed from the start, at 0: an alert on `increase()` of a series
        // that first appears at 1 would miss that first failure.
        for outcome in ["acquired", "busy", "error"] {
            let _ = lock_acquire.get_or_create(&Outcome { outcome });
        }
        registry.register(
            "lock_acquire",
            "Lock acquisitions by outcome (acquired, busy, error)",
            lock_acquire.clone(),
        );
        let lock_hold = Histogram::new(seconds_buckets());
        registry.register("lock_hold_seconds", "Time a session lock was held", lock_hold.clone());
        let lock_renewals = Family::<Outcome, Counter>::default();
        for outcome in ["renewed", "failed"] {
            let _ = lock_renewals.get_or_create(&Outcome { outcome });
        }
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
        let requeued = Counter::default();
        registry.register(
            "writes_requeued",
            "Writes queued again after meeting another turn's commit, to be re-read and re-merged",
            requeued.clone(),
        );
        let redis_restarts = Counter::default();
        registry.register(
            "redis_restarts_seen",
            "Times a new connection found another Redis server (a restart, or a failover): commits then wait out the write-backs that may have been in flight before",
            redis_restarts.clone(),
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
        let upstream_responses = Family::<OpStatus, Counter>::default();
        registry.register(
            "upstream_responses",
            "Store answers by operation (get, put, delete, forward; connect: no connection could be had) and HTTP status; status 0 = no answer",
            upstream_responses.clone(),
        );
        let upstream_retries = Counter::default();
        registry.register(
            "upstream_retries",
            "Safe store requests sent again on a fresh connection after a closed one failed",
            upstream_retries.clone(),
        );
        let requests = Family::<RouteStatus, Counter>::default();
        registry.register(
            "requests",
            "Agent requests by route, status and error code (empty on success)",
            requests.clone(),
        );
        let writes_in_flight = Gauge::default();
        registry.register(
            "writes_in_flight",
            "Writes received and not yet answered",
            writes_in_flight.clone(),
        );
        let dependency_up = Family::<DependencyLabel, Gauge>::default();
        registry.register(
            "dependency_up",
            "Whether a dependency (redis, store) answered its last background check",
            dependency_up.clone(),
        );
        let redis_errors = Family::<RedisFailure, Counter>::default();
        registry.register(
            "redis_errors",
            "Failed Redis commands by operation (try_acquire, renew, release, get, ping, …) and kind (timeout, io, refused, readonly, auth, server)",
            redis_errors.clone(),
        );
        let redis_node_up = Family::<NodeLabel, Gauge>::default();
        registry.register(
            "redis_node_up",
            "On a Redis Cluster, whether each primary (host:port) answered its last background check and said cluster_state:ok",
            redis_node_up.clone(),
        );
        let redis_node_check_failures = Family::<NodeLabel, Counter>::default();
        registry.register(
            "redis_node_check_failures",
            "On a Redis Cluster, background checks a primary (host:port) failed: no answer, an error, or cluster_state:fail",
            redis_node_check_failures.clone(),
        );
        let process = Process {
            resident: Gauge::default(),
            fds: Gauge::default(),
            cpu_ms: Counter::default(),
        };
        registry.register(
            "process_resident_memory_bytes",
            "Resident memory of the process",
            process.resident.clone(),
        );
        registry.register("process_open_fds", "Open file descriptors", process.fds.clone());
        registry.register(
            "process_cpu_milliseconds",
            "CPU time used by the process (user + system)",
            process.cpu_ms.clone(),
        );
        let build = Family::<Build, Gauge>::default();
        build
            .get_or_create(&Build {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register("build_info", "The running version (always 1)", build);
        let write_seconds = Histogram::new(seconds_buckets());
        registry.register(
            "write_seconds",
            "Time from a write's arrival to its answer: its wait for the session's turn, the read-merge-write and the store",
            write_seconds.clone(),
        );
        Self {
            inner: Arc::new(Inner {
                registry,
                lock_wait,
                lock_acquire,
                lock_hold,
                lock_renewals,
                stale,
                requeued,
                redis_restarts,
                replays,
                batch_size,
                upstream,
                upstream_responses,
                upstream_retries,
                requests,
                forwarded: StatusCounters::new(),
                store_forwarded: StatusCounters::new(),
                writes_in_flight,
                dependency_up,
                redis_errors,
                redis_node_up,
                redis_node_check_failures,
                process,
                write_seconds,
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

    pub fn requeued(&self, writes: usize) {
        self.inner.requeued.inc_by(writes as u64);
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

    /// One answered agent request; `code` is the answer's error code (empty on success).
    pub fn request(&self, route: &'static str, status: u16, code: &str) {
        let error = if code.is_empty() { "" } else { error_label(code) };
        let labels = RouteStatus { route, status, error };
        if route == "forward" && error.is_empty() {
            let make = || self.inner.requests.get_or_create(&labels).clone();
            if let Some(counter) = self.inner.forwarded.get(status, make) {
                counter.inc();
                return;
            }
        }
        self.inner.requests.get_or_create(&labels).inc();
    }

    /// One write answered (any answer, refusals included), `took` after it arrived.
    pub fn write_answered(&self, took: Duration) {
        self.inner.write_seconds.observe(took.as_secs_f64());
    }

    /// One store answer (`status` 0 when none came).
    pub fn upstream_response(&self, op: &'static str, status: u16) {
        let labels = OpStatus { op, status };
        if op == "forward" {
            let make = || self.inner.upstream_responses.get_or_create(&labels).clone();
            if let Some(counter) = self.inner.store_forwarded.get(status, make) {
                counter.inc();
                return;
            }
        }
        self.inner.upstream_responses.get_or_create(&labels).inc();
    }

    /// A store request sent again on a fresh connection.
    pub fn upstream_retry(&self) {
        self.inner.upstream_retries.inc();
    }

    /// Counts a write from its arrival until it is answered (also when its client goes away).
    pub fn write_in_flight(&self) -> InFlight {
        self.inner.writes_in_flight.inc();
        InFlight(self.inner.writes_in_flight.clone())
    }

    pub fn dependency_up(&self, dependency: &'static str, up: bool) {
        self.inner
            .dependency_up
            .get_or_create(&DependencyLabel { dependency })
            .set(i64::from(up));
    }

    /// One primary's result in the cluster health check: `redis_node_up{node}`, and a
    /// failure counted in `redis_node_check_failures_total{node}`. A node that left the
    /// layout keeps its last value until the process restarts.
    pub fn redis_node(&self, node: &str, up: bool) {
        let label = NodeLabel { node: node.to_owned() };
        self.inner.redis_node_up.get_or_create(&label).set(i64::from(up));
        if !up {
            self.inner.redis_node_check_failures.get_or_create(&label).inc();
        }
    }

    /// Drops a node's series once it is no longer a primary (failed over, or moved out).
    pub fn forget_redis_node(&self, node: &str) {
        let label = NodeLabel { node: node.to_owned() };
        self.inner.redis_node_up.remove(&label);
    }

    /// A new connection found another Redis server than before (see `redis_conn::restart`).
    pub fn redis_restart_seen(&self) {
        self.inner.redis_restarts.inc();
    }

    pub fn redis_error(&self, op: &'static str, kind: &'static str) {
        self.inner.redis_errors.get_or_create(&RedisFailure { op, kind }).inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        self.inner.process.refresh();
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.inner.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Decrements the in-flight writes gauge when dropped.
pub struct InFlight(Gauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

// === impl Process ===

impl Process {
    /// Reads `/proc/self` (Linux); elsewhere the gauges stay at zero.
    fn refresh(&self) {
        if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
            let rss_kb = status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok());
            if let Some(kb) = rss_kb {
                self.resident.set(kb * 1024);
            }
        }
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            self.fds.set(dir.count() as i64);
        }
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
            // Fields after the command name (which may hold spaces): utime is the 14th
            // field, stime the 15th, in clock ticks (100 per second on Linux).
            let fields: Vec<&str> = stat
                .rsplit_once(')')
                .map(|(_, rest)| rest.split_whitespace().collect())
                .unwrap_or_default();
            let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let ms = (ticks(11) + ticks(12)) * 10;
            let seen = self.cpu_ms.get();
            if ms > seen {
                self.cpu_ms.inc_by(ms - seen);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_labels_are_bounded_and_process_metrics_are_filled() {
        assert_eq!(error_label("session_busy"), "session_busy");
        assert_eq!(error_label("lock_unavailable"), "lock_unavailable");
        assert_eq!(error_label("anything a store says"), "other");
        let m = Metrics::new();
        m.request("append", 503, "session_busy");
        let text = m.encode();
        assert!(
            text.contains(r#"turnlock_requests_total{route="append",status="503",error="session_busy"} 1"#),
            "{text}"
        );
        assert!(text.contains("turnlock_build_info{version="), "{text}");
        m.upstream("get", Duration::from_secs(6));
        let text = m.encode();
        // A 6 s store answer (past the 5 s default timeout) lands in a finite bucket.
        assert!(
            text.contains(r#"turnlock_upstream_request_seconds_bucket{le="6.5536",op="get"} 1"#)
                || text.contains(r#"turnlock_upstream_request_seconds_bucket{op="get",le="6.5536"} 1"#),
            "{text}"
        );
        if cfg!(target_os = "linux") {
            assert!(!text.contains("turnlock_process_resident_memory_bytes 0\n"), "{text}");
            assert!(!text.contains("turnlock_process_open_fds 0\n"), "{text}");
        }
    }
}
