//! The answers the write pipeline gives when a write is not committed.

use std::time::Duration;

use http::header::{self, HeaderValue};
use http::StatusCode;
use serde_json::json;

use super::Shared;
use crate::lock::Locks;
use crate::merge::{self, MergeError};
use crate::proxy::answer::Answer;
use crate::upstream::UpstreamError;

/// The answer to a write whose budget ran out: `lock_unavailable` when Redis left its
/// commands unanswered all that time (a hung server is not contention), else `session_busy`.
pub(super) fn unanswered(locks: &Locks, budget: Duration) -> Answer {
    if locks.stalled(budget / 2) {
        Answer::retryable(
            "lock_unavailable",
            format!("the lock backend did not answer within {} ms", budget.as_millis()),
        )
    } else {
        busy(budget)
    }
}

pub(super) fn busy(budget: Duration) -> Answer {
    Answer::retryable(
        "session_busy",
        format!("the session's lock was not obtained within {} ms", budget.as_millis()),
    )
}

pub(super) fn lease_lost() -> Answer {
    Answer::retryable(
        "lease_lost",
        "the lock's lease was lost before the write; nothing was written",
    )
}

pub(super) fn write_conflict() -> Answer {
    Answer::retryable(
        "write_conflict",
        "a concurrent write of another turn kept moving the session; retry",
    )
}

pub(super) fn merge_refusal(s: &Shared, e: &MergeError) -> Answer {
    let (status, extra) = match e {
        MergeError::StaleTurn { current, .. } => {
            s.metrics.stale_rejected();
            (StatusCode::CONFLICT, Some(json!({"current_turn": current})))
        }
        MergeError::Conflict { fields } => (StatusCode::CONFLICT, Some(json!({"fields": fields}))),
        MergeError::MessageConflict { ids } => (StatusCode::CONFLICT, Some(json!({"message_ids": ids}))),
        MergeError::BaseUnknown { base } => (StatusCode::CONFLICT, Some(json!({"base_version": base}))),
        MergeError::VersionMismatch { current, .. } => (
            StatusCode::PRECONDITION_FAILED,
            Some(json!({"current_version": current})),
        ),
        MergeError::UnknownThrough { .. } => (StatusCode::CONFLICT, None),
        MergeError::NotFound => (StatusCode::NOT_FOUND, None),
        MergeError::VersionRequired => (StatusCode::PRECONDITION_REQUIRED, None),
        MergeError::PreviousLife => (StatusCode::CONFLICT, Some(json!({"fields": [merge::LIFE]}))),
    };
    Answer::error(status, e.code(), e, extra)
}

/// A write that would make the document larger than the limit: a 4xx, since a retry of it can
/// never pass.
pub(super) fn too_large_document(size: usize, limit: usize) -> Answer {
    Answer::error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "document_too_large",
        format!("the document would be {size} bytes, over the limit of {limit} bytes; nothing was written"),
        Some(json!({"size": size, "limit": limit})),
    )
}

pub(super) fn upstream_answer(e: &UpstreamError) -> Answer {
    if let UpstreamError::Status { status, .. } = e {
        if *status == StatusCode::PAYLOAD_TOO_LARGE {
            return Answer::error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "document_too_large",
                "the context store refused the document as too large (413); nothing was written",
                Some(json!({"upstream_status": 413})),
            );
        }
    }
    let extra = match e {
        UpstreamError::Status { status, .. } => Some(json!({"upstream_status": status.as_u16()})),
        _ => None,
    };
    let message = if e.outcome_unknown() {
        format!(
            "{e}; the outcome is unknown: the write may have been applied. A retry with the same \
             Idempotency-Key does not apply it twice"
        )
    } else {
        format!("{e}; nothing was written by this request")
    };
    let answer = Answer::error(e.status(), e.code(), message, extra);
    if matches!(e, UpstreamError::FencedOut) {
        return answer.with_header(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    answer
}
