//! Notices a Redis that restarted (and so may have lost every key: without persistence, a
//! restarted Redis comes back empty), from `INFO server` read on each new connection.
//!
//! A restart cuts every connection, so every proxy connected before it reconnects, and reads
//! the new `run_id` and uptime, before its next command reaches the restarted server. What
//! was in Redis before may be gone: the commit slot of a document whose write-back is still
//! in flight, among others. [`RedisConn::restart_hold`] says how long commits should still
//! wait for such write-backs.
//!
//! A single server and the primary Sentinel names are followed; a cluster's nodes are not
//! (redis-rs's cluster client reconnects to each node itself, out of sight).

use std::time::Instant;

use super::*;

/// What this connection learnt of the server it talks to.
#[derive(Default)]
pub(super) struct ServerSeen {
    /// Set once a restart was seen: a cheap test on the write path while nothing restarted.
    restart_seen: AtomicBool,
    state: std::sync::Mutex<SeenState>,
}

#[derive(Default)]
struct SeenState {
    /// The `run_id` of the server last connected to.
    run_id: Option<String>,
    /// When the server started, for the last restart seen.
    started: Option<Instant>,
}

/// The fields of `INFO server` this needs.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ServerInfo {
    pub(super) run_id: String,
    pub(super) uptime: Duration,
}

impl ServerInfo {
    pub(super) fn parse(text: &str) -> Option<Self> {
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        Some(Self {
            run_id: field("run_id").filter(|r| !r.is_empty())?.to_owned(),
            uptime: Duration::from_secs(field("uptime_in_seconds")?.parse().ok()?),
        })
    }
}

impl RedisConn {
    /// Reads `INFO server` on a new connection and notes when the server started, when it is
    /// not the server connected to before (a restart, or another server after a failover).
    /// A server that does not answer it (an ACL without `INFO`) is taken as unchanged.
    pub(super) async fn learn_server(&self, conn: &Conn) {
        let Conn::Single(c) = conn else { return };
        let mut c = c.clone();
        let asked = Instant::now();
        let text = match redis::cmd("INFO").arg("server").query_async::<String>(&mut c).await {
            Ok(text) => text,
            Err(error) => {
                // Asked on every new connection: during an outage that is every reconnect.
                if let Some(suppressed) = crate::telemetry::warn_allowed("INFO server") {
                    if error.code().is_some() {
                        // The server refused it (an ACL without `+info`, a renamed command).
                        tracing::warn!(%error, suppressed, "INFO server refused (does the ACL allow +info?): a Redis restart that lost the commit slots is not noticed");
                    } else {
                        tracing::warn!(%error, suppressed, "INFO server not answered: a Redis restart is noticed on the next connection that reads it");
                    }
                }
                return;
            }
        };
        let Some(info) = ServerInfo::parse(&text) else {
            tracing::debug!("INFO server without run_id or uptime_in_seconds");
            return;
        };
        // Uptime is in whole seconds: the start is taken as late as it can have been.
        let started = asked.checked_sub(info.uptime).unwrap_or(asked);
        let seen = &self.inner.server;
        let Ok(mut state) = seen.state.lock() else { return };
        let before = state.run_id.replace(info.run_id.clone());
        if before.is_none() || before.as_deref() == Some(info.run_id.as_str()) {
            return;
        }
        state.started = Some(started);
        seen.restart_seen.store(true, Ordering::Release);
        tracing::warn!(
            redis = self.display(),
            run_id = %info.run_id,
            uptime_secs = info.uptime.as_secs(),
            "Redis restarted (or another server answers): commit slots are taken again only once every write-back that could have been in flight has ended"
        );
        if let Some(metrics) = self.inner.metrics.get() {
            metrics.redis_restart_seen();
        }
    }

    /// How long commits should still wait after the last restart seen: what remains of
    /// `window` (the longest a write-back can be in flight) since that server started; `None`
    /// when no restart was seen or it started longer ago than that.
    pub fn restart_hold(&self, window: Duration) -> Option<Duration> {
        let seen = &self.inner.server;
        if !seen.restart_seen.load(Ordering::Acquire) {
            return None;
        }
        let started = seen.state.lock().ok()?.started?;
        let remaining = (started + window).checked_duration_since(Instant::now())?;
        (!remaining.is_zero()).then_some(remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_id_and_uptime_are_read_from_info_server() {
        let text = "# Server\r\nredis_version:7.0.15\r\nrun_id:8f1c2d\r\ntcp_port:6379\r\nuptime_in_seconds:42\r\n";
        assert_eq!(
            ServerInfo::parse(text),
            Some(ServerInfo {
                run_id: "8f1c2d".into(),
                uptime: Duration::from_secs(42)
            })
        );
        assert_eq!(ServerInfo::parse("# Server\r\nrun_id:x\r\n"), None);
        assert_eq!(ServerInfo::parse("uptime_in_seconds:1\r\n"), None);
    }
}
