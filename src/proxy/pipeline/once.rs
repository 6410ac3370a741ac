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
    let stored = Value::Object(stored);
    if let Some(pointer) = once.same.iter().find(|p| stored.pointer(p) != incoming.pointer(p)) {
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
