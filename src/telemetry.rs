//! Logging: human-readable by default, JSON with `TURNLOCK_LOG_FORMAT=json`, level from
//! `RUST_LOG` (default `info`). Colours only when stderr is a terminal. An invalid `RUST_LOG`
//! is refused rather than silently replaced.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

pub const LOG_FORMAT: &str = "TURNLOCK_LOG_FORMAT";

/// `RUST_LOG` did not parse as a filter, or `TURNLOCK_LOG_FORMAT` names no format.
#[derive(Debug, thiserror::Error)]
#[error("invalid {var} {value:?}: {reason}")]
pub struct BadFilter {
    var: &'static str,
    value: String,
    reason: String,
}

/// The filter from `RUST_LOG`, or `default` when it is unset or empty.
pub fn filter(rust_log: Option<&str>, default: &str) -> Result<EnvFilter, BadFilter> {
    match rust_log.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(EnvFilter::new(default)),
        Some(value) => EnvFilter::builder().parse(value).map_err(|e| BadFilter {
            var: "RUST_LOG",
            value: value.to_owned(),
            reason: e.to_string(),
        }),
    }
}

/// Keeps the log writer's thread: dropping it flushes what is queued (waiting a second at the
/// most).
pub struct LogGuard(#[allow(dead_code)] tracing_appender::non_blocking::WorkerGuard);

/// How many log lines may wait for stderr before new ones are dropped.
const QUEUED_LINES: usize = 16_384;

/// Installs the global subscriber; `default` is the level used when `RUST_LOG` is unset.
///
/// Lines are written to stderr by a thread of their own, through a bounded queue that drops
/// lines when full: a stderr nobody reads (a stalled log collector, a full pipe) costs log
/// lines, never the proxy's threads.
pub fn init(default: &str) -> Result<LogGuard, BadFilter> {
    let rust_log = std::env::var(EnvFilter::DEFAULT_ENV).ok();
    let filter = filter(rust_log.as_deref(), default)?;
    let json = match std::env::var(LOG_FORMAT) {
        Err(_) => false,
        Ok(v) if v.eq_ignore_ascii_case("json") => true,
        Ok(v) if v.is_empty() || v.eq_ignore_ascii_case("text") => false,
        Ok(v) => {
            return Err(BadFilter {
                var: LOG_FORMAT,
                value: v,
                reason: "the formats are `text` (the default) and `json`".into(),
            })
        }
    };
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(QUEUED_LINES)
        .thread_name("turnlock-log")
        .finish(std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        // A log line that cannot be written (stderr a pipe whose reader is gone) is dropped:
        // reporting it would print to that same stderr, which panics the task that logged, and
        // a signal handler that logs would then never start the shutdown.
        .log_internal_errors(false)
        .with_writer(writer);
    let _ = if json {
        builder.json().with_current_span(true).try_init()
    } else {
        builder.try_init()
    };
    Ok(LogGuard(guard))
}

/// How often one kind of repeated warning is logged.
pub const WARN_EVERY: Duration = Duration::from_secs(10);

static THROTTLE: Mutex<Option<HashMap<&'static str, (Instant, u64)>>> = Mutex::new(None);

/// Rate-limits a repeated warning: `Some(n)` when the warning `what` may be logged now, with
/// `n` the times it was held back since it last was; `None` (counted) within [`WARN_EVERY`]
/// of the last one. An outage is then a few lines, not one per failing request.
pub fn warn_allowed(what: &'static str) -> Option<u64> {
    let mut guard = THROTTLE.lock().unwrap_or_else(|p| p.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    let now = Instant::now();
    match map.get_mut(what) {
        Some((last, held)) if now.duration_since(*last) < WARN_EVERY => {
            *held += 1;
            None
        }
        Some((last, held)) => {
            let n = *held;
            *last = now;
            *held = 0;
            Some(n)
        }
        None => {
            map.insert(what, (now, 0));
            Some(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{filter, warn_allowed};

    #[test]
    fn a_repeated_warning_is_logged_once_per_period_with_the_count_held_back() {
        assert_eq!(warn_allowed("test warning"), Some(0));
        assert_eq!(warn_allowed("test warning"), None);
        assert_eq!(warn_allowed("test warning"), None);
        assert_eq!(warn_allowed("another warning"), Some(0));
    }

    #[test]
    fn a_filter_that_does_not_parse_is_refused_and_unset_means_the_default() {
        assert!(filter(None, "info").is_ok());
        assert!(filter(Some(""), "info").is_ok());
        assert!(filter(Some("turnlock=debug,warn"), "info").is_ok());
        assert!(filter(Some("turnlock=loud"), "info").is_err());
    }
}
