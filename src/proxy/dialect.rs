//! Answers in the store's dialect: for a route on a foreign store, the client gets what its
//! store's SDK expects — the store's own answer to the write-back on success, and turnlock's
//! refusals in a form the SDK raises as an error, without retrying a write that was applied.
//!
//! Which status and code each refusal takes is a table per dialect ([`S3_CODES`],
//! [`COUCHDB_CODES`]); the dialects themselves are described in [`crate::routes::dialect`].

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use serde_json::{json, Value};

use super::answer::Answer;
use super::request::Refusal;
use crate::http::{full, Body};
use crate::metrics::ErrorCode;
use crate::routes::{AnswerForm, Captures, Dialect};

/// A refusal in a store's terms: its status, its error code, and whether the SDK should try again.
struct StoreError {
    status: StatusCode,
    code: &'static str,
}

/// turnlock's refusals as S3 errors. botocore retries 5xx, `SlowDown` and `RequestTimeout`,
/// and raises anything else at once: a write that may have been applied (a conflict, a
/// stale turn) is never answered with a retried code; a write that was not applied (busy,
/// lock unavailable) is answered `503 SlowDown`, which SDKs retry with backoff.
const S3_CODES: &[(&str, u16, &str)] = &[
    ("stale_turn", 412, "PreconditionFailed"),
    ("version_mismatch", 412, "PreconditionFailed"),
    ("precondition_required", 412, "PreconditionFailed"),
    ("previous_life", 412, "PreconditionFailed"),
    ("conflict", 409, "ConditionalRequestConflict"),
    ("session_not_found", 404, "NoSuchKey"),
    // `IfMatch` on a key S3 does not hold: 404, as S3 answers it.
    ("nothing_to_match", 404, "NoSuchKey"),
    ("body_too_large", 400, "EntityTooLarge"),
    ("document_too_large", 400, "EntityTooLarge"),
    ("body_timeout", 400, "RequestTimeout"),
    ("idempotency_key_reused", 400, "InvalidRequest"),
    // The stored object is not a JSON document: no retry can change that.
    ("upstream_invalid_document", 409, "InvalidDocument"),
];

/// turnlock's refusals as CouchDB errors (`{"error", "reason"}`).
const COUCHDB_CODES: &[(&str, u16, &str)] = &[
    ("stale_turn", 409, "conflict"),
    ("version_mismatch", 409, "conflict"),
    ("precondition_required", 409, "conflict"),
    ("previous_life", 409, "conflict"),
    ("conflict", 409, "conflict"),
    ("session_not_found", 404, "not_found"),
    // A `_rev` of a document the store does not hold is CouchDB's conflict.
    ("nothing_to_match", 409, "conflict"),
    ("body_too_large", 413, "too_large"),
    ("document_too_large", 413, "too_large"),
    ("upstream_invalid_document", 409, "invalid_document"),
    // CouchDB's own names for these: its answer to a body that is not JSON in UTF-8, and the
    // name of the status of a body the client stopped sending.
    ("unsupported_media_type", 415, "bad_content_type"),
    ("unsupported_charset", 415, "bad_content_type"),
    ("body_timeout", 408, "request_timeout"),
];

fn store_error(table: &[(&str, u16, &'static str)], code: &str, status: StatusCode, s3: bool) -> StoreError {
    if let Some((_, st, c)) = table.iter().find(|(t, _, _)| *t == code) {
        return StoreError {
            status: StatusCode::from_u16(*st).unwrap_or(status),
            code: c,
        };
    }
    let (status, code) = match (status.as_u16(), s3) {
        (503, true) => (status, "SlowDown"),
        (503, false) => (status, "service_unavailable"),
        (500..=599, true) => (StatusCode::INTERNAL_SERVER_ERROR, "InternalError"),
        (500..=599, false) => (status, "internal_server_error"),
        (415, true) => (StatusCode::BAD_REQUEST, "InvalidArgument"),
        (428, true) => (StatusCode::PRECONDITION_FAILED, "PreconditionFailed"),
        (_, true) => (StatusCode::BAD_REQUEST, "InvalidRequest"),
        (_, false) => (status, "bad_request"),
    };
    StoreError { status, code }
}

/// The answer to a write that went through the pipeline, in the route's dialect.
pub fn answer(dialect: &Dialect, captures: &Captures, answer: Answer) -> Response<Body> {
    let code = answer.code();
    if answer.passed_on {
        return answer.into_response();
    }
    let mut res = match dialect.answer {
        AnswerForm::Turnlock => return answer.into_response(),
        AnswerForm::S3 if answer.status.is_success() => {
            // What S3 answers a PutObject: an empty 200 with the object's new ETag.
            let mut res = Response::new(crate::http::empty());
            copy_header(&answer, header::ETAG, &mut res);
            res
        }
        AnswerForm::Couchdb if answer.status.is_success() => {
            let rev = header_of(&answer, header::ETAG)
                .map(|v| v.trim_matches('"').to_owned())
                .unwrap_or_default();
            // The id as CouchDB names it: the path's segment decoded (`a%20b` is `a b`).
            let id = percent_encoding::percent_decode_str(&captures.session).decode_utf8_lossy();
            let body = json!({"ok": true, "id": id, "rev": rev});
            let mut res = json_response(StatusCode::CREATED, &body);
            copy_header(&answer, header::ETAG, &mut res);
            res
        }
        form if store_refusal(&answer.body).is_some() => {
            // The store refused the request turnlock made for the client (a missing bucket,
            // access denied): the client gets the store's own answer, as it would directly.
            let (status, body) = store_refusal(&answer.body).unwrap_or_default();
            let mut res = Response::new(full(Bytes::from(body)));
            *res.status_mut() = status;
            let content_type = match form {
                AnswerForm::S3 => "application/xml",
                _ => "application/json",
            };
            res.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            res
        }
        form => {
            let message = message_of(&answer.body);
            let mut res = in_form(form, code, answer.status, &message);
            copy_header(&answer, header::RETRY_AFTER, &mut res);
            res
        }
    };
    res.extensions_mut().insert(ErrorCode(code));
    res
}

/// A refusal at the edge (before any lock), in the route's dialect.
pub fn refusal(dialect: &Dialect, refusal: Refusal) -> Response<Body> {
    if dialect.answer == AnswerForm::Turnlock {
        return refusal.into_response();
    }
    let code = crate::metrics::error_label(refusal.code);
    let mut res = in_form(dialect.answer, refusal.code, refusal.status, &refusal.message);
    res.extensions_mut().insert(ErrorCode(code));
    res
}

fn in_form(form: AnswerForm, code: &str, status: StatusCode, message: &str) -> Response<Body> {
    match form {
        AnswerForm::S3 => {
            let e = store_error(S3_CODES, code, status, true);
            let body = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{}</Code><Message>{}</Message><TurnlockError>{}</TurnlockError><RequestId>turnlock</RequestId></Error>",
                e.code,
                xml_escape(message),
                xml_escape(code),
            );
            let mut res = Response::new(full(Bytes::from(body)));
            *res.status_mut() = e.status;
            res.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
            if e.status == StatusCode::SERVICE_UNAVAILABLE {
                res.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            res
        }
        AnswerForm::Couchdb => {
            let e = store_error(COUCHDB_CODES, code, status, false);
            json_response(
                e.status,
                &json!({"error": e.code, "reason": message, "turnlock_error": code}),
            )
        }
        AnswerForm::Turnlock => crate::http::error(status, code, message, None),
    }
}

fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    let mut res = Response::new(full(Bytes::from(serde_json::to_vec(body).unwrap_or_default())));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

fn header_of(answer: &Answer, name: header::HeaderName) -> Option<&str> {
    answer
        .headers
        .iter()
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| v.to_str().ok())
}

fn copy_header(answer: &Answer, name: header::HeaderName, res: &mut Response<Body>) {
    if let Some((_, v)) = answer.headers.iter().find(|(k, _)| *k == name) {
        res.headers_mut().insert(name, v.clone());
    }
}

/// The store's own refusal (a 4xx other than a conflict) a turnlock answer carries.
fn store_refusal(body: &[u8]) -> Option<(StatusCode, String)> {
    let v = serde_json::from_slice::<Value>(body).ok()?;
    let status = v["upstream_status"].as_u64().and_then(|s| u16::try_from(s).ok())?;
    let status = StatusCode::from_u16(status).ok().filter(StatusCode::is_client_error)?;
    let text = v["upstream_body"].as_str()?;
    Some((status, text.to_owned()))
}

fn message_of(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_refusals_are_never_retried_codes_unless_nothing_was_applied() {
        let s3 = |code, status| store_error(S3_CODES, code, StatusCode::from_u16(status).unwrap(), true);
        let stale = s3("stale_turn", 409);
        assert_eq!((stale.status.as_u16(), stale.code), (412, "PreconditionFailed"));
        let busy = s3("session_busy", 503);
        assert_eq!((busy.status.as_u16(), busy.code), (503, "SlowDown"));
        let conflict = s3("conflict", 409);
        assert_eq!(
            (conflict.status.as_u16(), conflict.code),
            (409, "ConditionalRequestConflict")
        );
        assert_eq!(s3("invalid_turn", 400).code, "InvalidRequest");
    }

    #[test]
    fn couchdb_refusals_carry_couchdb_error_names() {
        let couch = |code, status| store_error(COUCHDB_CODES, code, StatusCode::from_u16(status).unwrap(), false);
        let charset = couch("unsupported_charset", 415);
        assert_eq!((charset.status.as_u16(), charset.code), (415, "bad_content_type"));
        let slow = couch("body_timeout", 408);
        assert_eq!((slow.status.as_u16(), slow.code), (408, "request_timeout"));
        assert_eq!(couch("invalid_turn", 400).code, "bad_request");
        assert_eq!(couch("session_busy", 503).code, "service_unavailable");
    }

    #[test]
    fn xml_text_is_escaped() {
        assert_eq!(xml_escape("a<b & 'c'"), "a&lt;b &amp; &apos;c&apos;");
    }
}
