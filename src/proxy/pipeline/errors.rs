//! The pipeline's side of the error map: which [`WriteError`] a failure is (the answer for
//! each is decided in `proxy::error`).

use std::time::Duration;

use super::Shared;
use crate::lock::Locks;
use crate::merge::MergeError;
use crate::proxy::answer::Answer;
use crate::proxy::error::WriteError;

/// The answer to a write whose wait deadline (`waited` long) passed: `lock_unavailable` when
/// Redis has left its commands unanswered for half the lock budget (a hung server is not
/// contention), else `session_busy`.
pub(super) fn unanswered(locks: &Locks, budget: Duration, waited: Duration) -> Answer {
    if locks.stalled(budget / 2) {
        Answer::from(WriteError::LockStalled(budget))
    } else {
        Answer::from(WriteError::SessionBusy(waited))
    }
}

/// A write the merge rules refused (a stale turn is counted).
pub(super) fn refused(s: &Shared, e: MergeError) -> Answer {
    if matches!(e, MergeError::StaleTurn { .. }) {
        s.metrics.stale_rejected();
    }
    Answer::from(WriteError::Refused(e))
}
