//! Objects created once (one object per message, as agent frameworks lay out a session on an
//! object store): under the session's lock, a write to an object that already holds another
//! message is a stale turn, refused in the store's dialect (S3: `412 PreconditionFailed`),
//! never a silent replacement.
//!
//! What the store enforces itself rides on the forwarded write: a create carries
//! `If-None-Match: *`, a permitted rewrite `If-Match` with the ETag read, so a writer that
//! reaches the store without the sidecar between the read and the write is still not
//! overwritten (the store answers 412, passed back as it is).

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::StatusCode;
use serde_json::{json, Value};

use super::Shared;
use crate::proxy::answer::Answer;
use crate::proxy::error::WriteError;
use crate::proxy::request::Once;

/// The precondition the forwarded write carries, or the refusal of a write that would replace
/// a stored object with another: the stored object and the write disagree on one of the
/// `same` pointers (a different message at that index).
pub(super) async fn precondition(
    s: &Shared,
    resource: &str,
    body: &Bytes,
    once: &Once,
) -> Result<(HeaderName, HeaderValue), Answer> {
    let incoming: Value = serde_json::from_slice(body).map_err(|e| {
        Answer::error(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the body is not JSON: {e}"),
            None,
        )
    })?;
    let fetched = s
        .upstream
        .get_document_with(resource, &once.store)
        .await
        .map_err(|e| Answer::from(WriteError::Upstream(e)))?;
    let Some(stored) = fetched.doc else {
        return Ok((header::IF_NONE_MATCH, HeaderValue::from_static("*")));
    };
    if let Some(pointer) = differs(&Value::Object(stored), &incoming, &once.same) {
        s.metrics.stale_rejected();
        return Err(Answer::error(
            StatusCode::CONFLICT,
            "stale_turn",
            format!(
                "{resource} already holds another object ({pointer} differs): this write was based on a stale \
                 read of the session; read it again and retry"
            ),
            Some(json!({"object": resource, "differs": pointer})),
        ));
    }
    match fetched.etag {
        Some(etag) => Ok((header::IF_MATCH, etag)),
        // A store that names no version: the rewrite of the same message goes as it is.
        None => Ok((header::IF_MATCH, HeaderValue::from_static("*"))),
    }
}

/// The first of `same` (JSON pointers) at which a stored object and a write disagree: the write
/// would replace the object with another. A pointer absent from both agrees.
fn differs<'a>(stored: &Value, incoming: &Value, same: &'a [String]) -> Option<&'a str> {
    same.iter()
        .find(|p| stored.pointer(p) != incoming.pointer(p))
        .map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same() -> Vec<String> {
        ["/message_id", "/created_at", "/message"].map(String::from).to_vec()
    }

    #[test]
    fn a_redaction_by_the_writer_keeps_the_object() {
        let stored = json!({"message_id": 5, "created_at": "t1", "message": {"text": "card 4111"},
            "redact_message": null, "updated_at": "t1"});
        let redacted = json!({"message_id": 5, "created_at": "t1", "message": {"text": "card 4111"},
            "redact_message": {"text": "[redacted]"}, "updated_at": "t2"});
        assert_eq!(differs(&stored, &redacted, &same()), None);
        assert_eq!(differs(&stored, &stored, &same()), None, "a retry of the same write");
    }

    #[test]
    fn another_replicas_message_at_the_same_index_is_another_object() {
        let stored = json!({"message_id": 5, "created_at": "t1", "message": {"text": "a"}});
        let other = json!({"message_id": 5, "created_at": "t9", "message": {"text": "b"}});
        assert_eq!(differs(&stored, &other, &same()), Some("/created_at"));
        let same_time = json!({"message_id": 5, "created_at": "t1", "message": {"text": "b"}});
        assert_eq!(differs(&stored, &same_time, &same()), Some("/message"));
        let missing = json!({"message_id": 5, "message": {"text": "a"}});
        assert_eq!(differs(&stored, &missing, &same()), Some("/created_at"));
    }
}
