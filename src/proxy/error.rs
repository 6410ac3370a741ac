//! The error map: why a write was not committed, as one typed value, and the one place that
//! decides the status, error code, extra fields and `Retry-After` of each answer.
//!
//! A store failure keeps telling "nothing was sent" from "the outcome is unknown"
//! ([`UpstreamError::outcome_unknown`]): only the second may have been applied, and only it
//! says so to the client.

use std::time::Duration;

use http::header::{self, HeaderValue};
use http::StatusCode;
use serde_json::json;

use super::answer::Answer;
use crate::merge::{self, MergeError};
use crate::upstream::UpstreamError;

/// Why a write was not committed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The session's lock was not obtained within the budget.
    #[error("the session's lock was not obtained within {} ms", .0.as_millis())]
    SessionBusy(Duration),
    /// Redis left the lock's commands unanswered for the whole budget.
    #[error("the lock backend did not answer within {} ms", .0.as_millis())]
    LockStalled(Duration),
    /// The lock or record backend failed (the message says how).
    #[error("{0}")]
    LockUnavailable(String),
    /// The lease ran out before the write-back: nothing was written.
    #[error("the lock's lease was lost before the write; nothing was written")]
    LeaseLost,
    /// Writers of other turns kept moving the document past every re-read.
    #[error("a concurrent write of another turn kept moving the session; retry")]
    KeptMoving,
    /// Another write of the document (of another turn, or one whose outcome is unknown and
    /// may still land) still held its commit slot after half a lease.
    #[error(
        "an earlier write to this document is still in flight, or its outcome is unknown and it may still land (its commit slot lapses within the store timeout plus a lease); retry"
    )]
    CommitInFlight,
    /// The merge rules refused the write.
    #[error(transparent)]
    Refused(#[from] MergeError),
    /// The document the write would produce is over `--max-document-bytes`.
    #[error("the document would be {size} bytes, over the limit of {limit} bytes; nothing was written")]
    DocumentTooLarge { size: usize, limit: usize },
    /// The store failed or refused.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// The store failed on a session delete, which keeps no idempotency record (a repeated
    /// delete is answered by the store).
    #[error(transparent)]
    DeleteFailed(UpstreamError),
    /// The store failed on turnlock's read of the document, before anything was written.
    #[error("{0}, on turnlock's read of the document")]
    ReadFailed(UpstreamError),
    /// The route's path does not make a URI on the store.
    #[error("{0}")]
    InvalidPath(String),
    /// The idempotency record under the key could not be read.
    #[error("the idempotency record could not be read")]
    RecordUnreadable,
    /// The idempotency key was used for a request with another payload.
    #[error("this Idempotency-Key was used for a different request")]
    KeyReused,
    /// A request with the same idempotency key is still running.
    #[error("a request with this Idempotency-Key is in progress")]
    InProgress,
    /// turnlock's own fault (the message says which).
    #[error("{0}")]
    Internal(&'static str),
}

impl From<WriteError> for Answer {
    fn from(e: WriteError) -> Self {
        let retryable = |code: &str, e: &WriteError| Answer::retryable(code, e);
        match &e {
            WriteError::SessionBusy(_) => retryable("session_busy", &e),
            WriteError::LockStalled(_) | WriteError::LockUnavailable(_) => retryable("lock_unavailable", &e),
            WriteError::LeaseLost => retryable("lease_lost", &e),
            WriteError::KeptMoving | WriteError::CommitInFlight => retryable("write_conflict", &e),
            WriteError::RecordUnreadable => retryable("idempotency_record_unreadable", &e),
            WriteError::InProgress => retryable("request_in_progress", &e),
            WriteError::KeyReused => {
                Answer::error(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused", &e, None)
            }
            WriteError::Refused(m) => refused(m),
            WriteError::DocumentTooLarge { size, limit } => Answer::error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "document_too_large",
                &e,
                Some(json!({"size": size, "limit": limit})),
            ),
            WriteError::Upstream(u) => upstream(u, u.outcome_unknown().then_some(RETRY_WRITE)),
            WriteError::DeleteFailed(u) => upstream(u, u.outcome_unknown().then_some(RETRY_DELETE)),
            WriteError::ReadFailed(u) => upstream(u, None),
            WriteError::InvalidPath(_) => Answer::error(StatusCode::BAD_REQUEST, "invalid_path", &e, None),
            WriteError::Internal(_) => Answer::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", &e, None),
        }
    }
}

/// Why a request was answered outside the write pipeline: refused at the edge before any lock
/// (the request does not make a valid write, or its body is too large or too slow), by routing
/// (the path), by the pass-through (the store failed), by the panic guard, or by transparent
/// mode's choice of destination. Its status, code and extra fields are decided here, in
/// [`Refusal::from`], as a write's are in `From<WriteError> for Answer`.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    /// The request does not make a valid write; `code` names what to fix (`invalid_messages`,
    /// `malformed_json`, `invalid_session_id`, …).
    #[error("{message}")]
    Invalid { code: &'static str, message: String },
    /// A replacement without `If-Match`.
    #[error("{0}")]
    PreconditionRequired(&'static str),
    /// A weak `If-Match` where a strong one is needed.
    #[error("If-Match is compared strongly (RFC 9110): a weak entity tag (W/\"…\") never matches")]
    WeakIfMatch,
    /// `If-Match: *` (a stored document) with version 0 (none stored).
    #[error("If-Match: * asks for a stored session, and version 0 names none: nothing was written")]
    AnyButAbsent,
    /// A write body that is not declared JSON.
    #[error("writes must be JSON (application/json or application/merge-patch+json), not {0:?}")]
    UnsupportedMediaType(String),
    /// A body said to be in a character set other than UTF-8.
    #[error("writes are JSON in UTF-8, not in {0:?}: send the body in UTF-8")]
    UnsupportedCharset(String),
    /// A body over the write limit, declared or streamed.
    #[error("the body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// A body not received in time.
    #[error("the body was not received within {} s", .0.as_secs())]
    BodyTimeout(Duration),
    /// A path that matches several write routes.
    #[error("{0}")]
    AmbiguousPath(String),
    /// A path that does not make a URI on the store.
    #[error("{0}")]
    InvalidPath(String),
    /// The store failed a request passed through (or turnlock could not sign it for the store).
    #[error(transparent)]
    Forward(#[from] UpstreamError),
    /// What HTTP itself asks of a server and turnlock does not do (`code` says what): a
    /// `CONNECT`, a transfer coding other than `chunked`. Answered 501.
    #[error("{message}")]
    NotImplemented { code: &'static str, message: String },
    /// A request handler panicked.
    #[error("turnlock failed while handling this request")]
    Panic,
    /// Transparent mode has no store for an intercepted destination (`code` says why).
    #[error("{message}")]
    NoDestination { code: &'static str, message: String },
    /// The sidecar's own connection was intercepted and sent back to it.
    #[error(
        "the sidecar's own connection to {0} was intercepted and sent back to it: it runs as a user id \
         the interception rules do not exclude"
    )]
    ForwardingLoop(std::net::SocketAddr),
}

/// An answer decided outside the write pipeline (see [`EdgeError`]): a status, a specific
/// error code, a message saying what to fix, and extra fields; put in the route's dialect by
/// `proxy::dialect`, or as turnlock's JSON by [`Refusal::into_response`].
#[derive(Debug)]
pub struct Refusal {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub extra: Option<serde_json::Value>,
}

impl From<EdgeError> for Refusal {
    fn from(e: EdgeError) -> Self {
        let (status, code, extra) = match &e {
            EdgeError::Invalid { code, .. } => (StatusCode::BAD_REQUEST, *code, None),
            EdgeError::PreconditionRequired(_) => (StatusCode::PRECONDITION_REQUIRED, "precondition_required", None),
            EdgeError::WeakIfMatch => (StatusCode::PRECONDITION_FAILED, "version_mismatch", None),
            EdgeError::AnyButAbsent => (StatusCode::PRECONDITION_FAILED, "version_mismatch", None),
            EdgeError::UnsupportedMediaType(_) => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", None),
            EdgeError::UnsupportedCharset(_) => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_charset", None),
            EdgeError::BodyTooLarge { limit } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                Some(json!({"limit": limit})),
            ),
            EdgeError::BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "body_timeout", None),
            EdgeError::AmbiguousPath(_) => (StatusCode::BAD_REQUEST, "ambiguous_path", None),
            EdgeError::InvalidPath(_) => (StatusCode::BAD_REQUEST, "invalid_path", None),
            EdgeError::Forward(u) => (u.status(), u.code(), None),
            EdgeError::NotImplemented { code, .. } => (StatusCode::NOT_IMPLEMENTED, *code, None),
            EdgeError::Panic => (StatusCode::INTERNAL_SERVER_ERROR, "internal", None),
            EdgeError::NoDestination { code, .. } => (StatusCode::BAD_GATEWAY, *code, None),
            EdgeError::ForwardingLoop(_) => (StatusCode::LOOP_DETECTED, "forwarding_loop", None),
        };
        Refusal {
            status,
            code,
            message: e.to_string(),
            extra,
        }
    }
}

impl Refusal {
    /// The answer in turnlock's JSON (`{"error", "message", …}`).
    pub fn into_response(self) -> http::Response<crate::http::Body> {
        let label = crate::metrics::error_label(self.code);
        let mut res = crate::http::error(self.status, self.code, self.message, self.extra);
        res.extensions_mut().insert(crate::metrics::ErrorCode(label));
        res
    }
}

impl EdgeError {
    /// The answer in turnlock's JSON.
    pub fn into_response(self) -> http::Response<crate::http::Body> {
        Refusal::from(self).into_response()
    }
}

fn refused(e: &MergeError) -> Answer {
    let (status, extra) = match e {
        MergeError::StaleTurn { current, .. } => (StatusCode::CONFLICT, Some(json!({"current_turn": current}))),
        MergeError::Conflict { fields } => (StatusCode::CONFLICT, Some(json!({"fields": fields}))),
        MergeError::MessageConflict { ids } => (StatusCode::CONFLICT, Some(json!({"message_ids": ids}))),
        MergeError::BaseUnknown { base } => (StatusCode::CONFLICT, Some(json!({"base_version": base}))),
        MergeError::VersionMismatch { current, .. } | MergeError::Exists { current } => (
            StatusCode::PRECONDITION_FAILED,
            Some(json!({"current_version": current})),
        ),
        MergeError::UnknownThrough { .. } => (StatusCode::CONFLICT, None),
        MergeError::NotFound => (StatusCode::NOT_FOUND, None),
        MergeError::NothingToMatch => (StatusCode::PRECONDITION_FAILED, None),
        MergeError::VersionRequired => (StatusCode::PRECONDITION_REQUIRED, None),
        MergeError::PreviousLife => (StatusCode::CONFLICT, Some(json!({"fields": [merge::LIFE]}))),
    };
    Answer::error(status, e.code(), e, extra)
}

/// How much of a store's refusal is kept to answer it with.
const STORE_BODY_KEPT: usize = 8 * 1024;

/// What a retry of a write whose outcome is unknown does.
const RETRY_WRITE: &str = "A retry with the same Idempotency-Key does not apply it twice";
/// What a repeat of a delete whose outcome is unknown does.
const RETRY_DELETE: &str = "A repeated delete is answered by the store (usually 404 if this one was applied)";

/// The answer to a store's failure or refusal; with what a retry does when a write was sent
/// and its outcome is unknown.
fn upstream(e: &UpstreamError, unknown: Option<&str>) -> Answer {
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
        // A store's refusal of a request turnlock made for the client (a missing bucket, a
        // denied access) is the store's answer to give: kept, for answers in its dialect.
        UpstreamError::Status { status, body } if status.is_client_error() => Some(json!({
            "upstream_status": status.as_u16(),
            "upstream_body": String::from_utf8_lossy(&body[..body.len().min(STORE_BODY_KEPT)]),
        })),
        UpstreamError::Status { status, .. } => Some(json!({"upstream_status": status.as_u16()})),
        _ => None,
    };
    let message = match unknown {
        Some(retry) => format!("{e}; the outcome is unknown: the write may have been applied. {retry}"),
        None => format!("{e}; nothing was written by this request"),
    };
    let answer = Answer::error(e.status(), e.code(), message, extra);
    if matches!(e, UpstreamError::FencedOut) {
        return answer.with_header(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(a: &Answer) -> serde_json::Value {
        serde_json::from_slice(&a.body).unwrap_or_default()
    }

    fn retry_after(a: &Answer) -> bool {
        a.headers.iter().any(|(k, _)| k == header::RETRY_AFTER)
    }

    #[test]
    fn lock_failures_are_retryable_503s_with_their_own_codes() {
        let cases = [
            (WriteError::SessionBusy(Duration::from_millis(50)), "session_busy"),
            (WriteError::LockStalled(Duration::from_millis(50)), "lock_unavailable"),
            (WriteError::LockUnavailable("down".into()), "lock_unavailable"),
            (WriteError::LeaseLost, "lease_lost"),
            (WriteError::KeptMoving, "write_conflict"),
            (WriteError::CommitInFlight, "write_conflict"),
            (WriteError::InProgress, "request_in_progress"),
            (WriteError::RecordUnreadable, "idempotency_record_unreadable"),
        ];
        for (e, code) in cases {
            let a = Answer::from(e);
            assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{code}");
            assert_eq!(body(&a)["error"], code);
            assert_eq!(body(&a)["retryable"], true, "{code}");
            assert!(retry_after(&a), "{code} without Retry-After");
            assert!(!a.is_final(), "{code} would be recorded as final");
        }
    }

    #[test]
    fn merge_refusals_are_final_4xx_with_their_details() {
        let a = Answer::from(WriteError::from(MergeError::StaleTurn { turn: 3, current: 7 }));
        assert_eq!(a.status, StatusCode::CONFLICT);
        assert_eq!(body(&a)["error"], "stale_turn");
        assert_eq!(body(&a)["current_turn"], 7);
        assert!(a.is_final());
        let a = Answer::from(WriteError::from(MergeError::VersionRequired));
        assert_eq!(a.status, StatusCode::PRECONDITION_REQUIRED);
        let a = Answer::from(WriteError::DocumentTooLarge { size: 10, limit: 5 });
        assert_eq!(
            (a.status, body(&a)["limit"].as_u64()),
            (StatusCode::PAYLOAD_TOO_LARGE, Some(5))
        );
        assert_eq!(body(&a)["error"], "document_too_large");
    }

    #[test]
    fn edge_refusals_get_their_status_and_code_here() {
        let cases: [(EdgeError, StatusCode, &str); 12] = [
            (
                EdgeError::Invalid {
                    code: "malformed_json",
                    message: "x".into(),
                },
                StatusCode::BAD_REQUEST,
                "malformed_json",
            ),
            (
                EdgeError::PreconditionRequired("needs If-Match"),
                StatusCode::PRECONDITION_REQUIRED,
                "precondition_required",
            ),
            (
                EdgeError::WeakIfMatch,
                StatusCode::PRECONDITION_FAILED,
                "version_mismatch",
            ),
            (
                EdgeError::UnsupportedMediaType("text/plain".into()),
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
            ),
            (
                EdgeError::BodyTooLarge { limit: 10 },
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
            ),
            (
                EdgeError::BodyTimeout(Duration::from_secs(10)),
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
            ),
            (
                EdgeError::AmbiguousPath("a".into()),
                StatusCode::BAD_REQUEST,
                "ambiguous_path",
            ),
            (
                EdgeError::InvalidPath("p".into()),
                StatusCode::BAD_REQUEST,
                "invalid_path",
            ),
            (
                EdgeError::Forward(UpstreamError::Unreachable("refused".into())),
                StatusCode::BAD_GATEWAY,
                "upstream_unavailable",
            ),
            (EdgeError::Panic, StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            (
                EdgeError::NoDestination {
                    code: "unknown_destination",
                    message: "m".into(),
                },
                StatusCode::BAD_GATEWAY,
                "unknown_destination",
            ),
            (
                EdgeError::ForwardingLoop(std::net::SocketAddr::from(([127, 0, 0, 1], 80))),
                StatusCode::LOOP_DETECTED,
                "forwarding_loop",
            ),
        ];
        for (e, status, code) in cases {
            let r = Refusal::from(e);
            assert_eq!((r.status, r.code), (status, code));
            assert!(!r.message.is_empty(), "{code} without a message");
        }
        let r = Refusal::from(EdgeError::BodyTooLarge { limit: 10 });
        assert_eq!(r.extra, Some(json!({"limit": 10})));
        let timeout = Refusal::from(EdgeError::Forward(UpstreamError::Timeout(Duration::from_secs(5))));
        assert_eq!(
            (timeout.status, timeout.code),
            (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout")
        );
        let res = EdgeError::Panic.into_response();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn store_failures_say_whether_the_write_may_have_landed() {
        let unknown = Answer::from(WriteError::from(UpstreamError::Timeout(Duration::from_secs(5))));
        assert_eq!(unknown.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(body(&unknown)["error"], "upstream_timeout");
        assert!(body(&unknown)["message"]
            .as_str()
            .unwrap_or("")
            .contains("outcome is unknown"));
        let not_sent = Answer::from(WriteError::from(UpstreamError::NotSent("refused".into())));
        assert_eq!(not_sent.status, StatusCode::BAD_GATEWAY);
        assert_eq!(body(&not_sent)["error"], "upstream_unavailable");
        assert!(body(&not_sent)["message"]
            .as_str()
            .unwrap_or("")
            .contains("nothing was written"));
        let too_large = Answer::from(WriteError::from(UpstreamError::Status {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            body: Default::default(),
        }));
        assert_eq!(body(&too_large)["error"], "document_too_large");
        let delete = Answer::from(WriteError::DeleteFailed(UpstreamError::Unreachable("reset".into())));
        let message = body(&delete)["message"].as_str().unwrap_or("").to_owned();
        assert!(message.contains("outcome is unknown"), "{message}");
        assert!(!message.contains("Idempotency-Key"), "{message}");
        let fenced = Answer::from(WriteError::from(UpstreamError::FencedOut));
        assert_eq!(fenced.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(retry_after(&fenced));
    }
}
