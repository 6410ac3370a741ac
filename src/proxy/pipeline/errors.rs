//! The pipeline's side of the error map: which [`WriteError`] a failure is (the answer for
//! each is decided in `proxy::error`).

use std::time::Duration;

use super::Shared;
use crate::lock::Locks;
use crate::merge::MergeError;
use crate::proxy::answer::Answer;
use crate::proxy::error::WriteError;

/// The answer to a write whose budget ran out: `lock_unavailable` when Redis left its
/// commands unanswered all that time (a hung server is not contention), else `session_busy`.
pub(super) fn unanswered(locks: &Locks, budget: Duration) -> Answer {
    if locks.stalled(budget / 2) {
        Answer::from(WriteError::LockStalled(budget))
    } else {
        Answer::from(WriteError::SessionBusy(budget))
    }
}

/// A write the merge rules refused (a stale turn is counted).
pub(super) fn refused(s: &Shared, e: MergeError) -> Answer {
    if matches!(e, MergeError::StaleTurn { .. }) {
        s.metrics.stale_rejected();
    }
    Answer::from(WriteError::Refused(e))
}
