//! Notices a Redis that stopped answering, without waiting for each command's timeout.

use super::*;

/// Notices a Redis that stopped answering without waiting for each command's timeout: while
/// commands are outstanding, how long since the last one was sent to an idle, answering
/// connection or answered. A command that timed out or lost its connection is no answer: the
/// silence it began goes on with the next command.
pub(super) struct Progress {
    base: std::time::Instant,
    in_flight: AtomicUsize,
    since_us: AtomicU64,
    /// The last command ended without an answer from Redis.
    silent: AtomicBool,
}

pub(super) struct Outstanding<'a> {
    pub(super) progress: &'a Progress,
    /// Whether Redis answered the command; `None` when the caller gave up on it first (it then
    /// says nothing about Redis).
    pub(super) answered: Option<bool>,
}

impl Progress {
    pub(super) fn new() -> Self {
        Self {
            base: std::time::Instant::now(),
            in_flight: AtomicUsize::new(0),
            since_us: AtomicU64::new(0),
            silent: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub(super) fn now_us(&self) -> u64 {
        self.base.elapsed().as_micros() as u64
    }

    pub(super) fn begin(&self) -> Outstanding<'_> {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) == 0 && !self.silent.load(Ordering::Acquire) {
            self.since_us.store(self.now_us(), Ordering::Release);
        }
        Outstanding {
            progress: self,
            answered: None,
        }
    }

    pub(super) fn stalled_for(&self) -> Duration {
        if self.in_flight.load(Ordering::Acquire) == 0 {
            return Duration::ZERO;
        }
        let since = self.since_us.load(Ordering::Acquire);
        Duration::from_micros(self.now_us().saturating_sub(since))
    }
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        let p = self.progress;
        if let Some(answered) = self.answered {
            if answered {
                p.since_us.store(p.now_us(), Ordering::Release);
            }
            p.silent.store(!answered, Ordering::Release);
        }
        p.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}
