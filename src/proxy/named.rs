//! Writes that name their document in the body, not the path: CouchDB's `POST /{db}` with an
//! `_id` (nano's `db.insert(doc)`, CouchDB-Python's `db.save(doc)`) creates or updates that
//! document as its `PUT /{db}/{id}` does. Such a `POST`, when the `PUT` is a write route's,
//! is taken through the write pipeline as that `PUT`, not past the lock.

use http::{header, HeaderValue, Method, Request, Uri};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use super::error::{EdgeError, Refusal};
use super::request::{self, read_limited, BODY_READ_TIMEOUT};
use crate::http::Body;
use crate::routes::{Dialect, Routes};

/// What a document id is written as in a path: everything but letters, digits, `-`, `_` and
/// `~` escaped (`/` as `%2F`: a character of the id, not a segment).
const ID: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'~');

/// `req` as the `PUT` of the document its body names, when that `PUT` is a write route's;
/// else `req` as it came (its body read, when it had to be looked at). A refusal (a body too
/// large or too slow to look at, one the proxy cannot read, a path the stores read two ways)
/// is answered in the dialect of the routes that made the body worth reading.
pub async fn as_document_write(
    routes: &Routes,
    req: Request<Body>,
    limits: request::Limits,
) -> Result<Request<Body>, (&'static Dialect, Refusal)> {
    let Some((field, dialect)) = worth_reading(routes, &req) else {
        return Ok(req);
    };
    let refuse = |e: EdgeError| (dialect, Refusal::from(e));
    // A coded body is refused rather than passed on unread: the store would decode it and
    // might find a session's document named in it.
    if req
        .headers()
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))
    {
        return Err(refuse(EdgeError::Invalid {
            code: "unsupported_content_encoding",
            message: format!(
                "a POST here may write a session's document (named by its \"{field}\"), so turnlock reads \
                 its body: send it without Content-Encoding"
            ),
        }));
    }
    // The limit of a whole document's `PUT`: a body this POST stands for.
    let max = limits.body.max(limits.document);
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(refuse(EdgeError::BodyTooLarge { limit: max }));
    }
    let (mut parts, body) = req.into_parts();
    let bytes = match tokio::time::timeout(BODY_READ_TIMEOUT, read_limited(body, max)).await {
        Err(_) => return Err(refuse(EdgeError::BodyTimeout(BODY_READ_TIMEOUT))),
        Ok(Err(None)) => return Err(refuse(EdgeError::BodyTooLarge { limit: max })),
        Ok(Err(Some(e))) => {
            return Err(refuse(EdgeError::Invalid {
                code: "body_read_failed",
                message: format!("could not read the request body: {e}"),
            }))
        }
        Ok(Ok(bytes)) => bytes,
    };
    // Sent on with its length stated (it may have come chunked).
    parts.headers.remove(header::TRANSFER_ENCODING);
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    let unchanged = |parts, bytes| Request::from_parts(parts, crate::http::full(bytes));
    // No id (the store makes one up: a new document, no other writer's), or a body the store
    // refuses as it is not a JSON object: passed on as it came.
    let Some(id) = named_id(&bytes, field) else {
        return Ok(unchanged(parts, bytes));
    };
    let collection = parts.uri.path();
    let collection = collection.strip_suffix('/').unwrap_or(collection);
    let mut target = format!("{collection}/{}", utf8_percent_encode(&id, ID));
    if let Some(query) = parts.uri.query() {
        target.push('?');
        target.push_str(query);
    }
    let Ok(uri) = target.parse::<Uri>() else {
        return Ok(unchanged(parts, bytes));
    };
    match routes.find(&Method::PUT, uri.path()) {
        Ok(Some((route, captures)))
            if route.dialect.named_in_body == Some(field)
                && !route
                    .dialect
                    .not_a_write(&Method::PUT, &uri, &parts.headers, &captures.session) =>
        {
            tracing::debug!(%uri, "a POST naming its document in its body: written as the PUT of that document");
            parts.method = Method::PUT;
            parts.uri = uri;
            Ok(Request::from_parts(parts, crate::http::full(bytes)))
        }
        Err(ambiguous) => Err((
            ambiguous.dialect,
            EdgeError::AmbiguousPath(ambiguous.to_string()).into(),
        )),
        Ok(_) => Ok(unchanged(parts, bytes)),
    }
}

/// The field naming the document, and the dialect it belongs to, when `req` is a `POST` whose
/// body may name a write route's document: not one the routes name themselves, not to a
/// database's own resource (a last name starting with `_`: `_bulk_docs`, `_find`, `_purge`),
/// and not a multipart upload (an attachment's form).
fn worth_reading(routes: &Routes, req: &Request<Body>) -> Option<(&'static str, &'static Dialect)> {
    if req.method() != Method::POST {
        return None;
    }
    let (field, dialect) = routes.named_in_body()?;
    if !matches!(routes.find(req.method(), req.uri().path()), Ok(None)) {
        return None;
    }
    let path = req.uri().path();
    let last = path
        .strip_suffix('/')
        .unwrap_or(path)
        .rsplit('/')
        .next()
        .unwrap_or_default();
    if percent_encoding::percent_decode_str(last)
        .decode_utf8_lossy()
        .starts_with('_')
    {
        return None;
    }
    let multipart = req.headers().get(header::CONTENT_TYPE).is_some_and(|v| {
        v.as_bytes()
            .trim_ascii_start()
            .to_ascii_lowercase()
            .starts_with(b"multipart/")
    });
    if multipart {
        return None;
    }
    Some((field, dialect))
}

/// The string in the body's top-level `field`, when the body is a JSON object holding one that
/// is not empty.
fn named_id(body: &[u8], field: &str) -> Option<String> {
    let serde_json::Value::Object(mut doc) = serde_json::from_slice(body).ok()? else {
        return None;
    };
    match doc.remove(field)? {
        serde_json::Value::String(id) if !id.is_empty() => Some(id),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_one_segment_of_the_path() {
        let encoded = utf8_percent_encode("a/b c?d#e%f.g_h-i~j", ID).to_string();
        assert_eq!(encoded, "a%2Fb%20c%3Fd%23e%25f%2Eg_h-i~j");
        assert_eq!(
            percent_encoding::percent_decode_str(&encoded).decode_utf8_lossy(),
            "a/b c?d#e%f.g_h-i~j"
        );
    }

    #[test]
    fn only_a_non_empty_string_id_names_a_document() {
        assert_eq!(
            named_id(br#"{"_id":"s-1","messages":[]}"#, "_id").as_deref(),
            Some("s-1")
        );
        assert_eq!(named_id(br#"{"messages":[]}"#, "_id"), None);
        assert_eq!(named_id(br#"{"_id":""}"#, "_id"), None);
        assert_eq!(named_id(br#"{"_id":7}"#, "_id"), None);
        assert_eq!(named_id(br#"[{"_id":"s-1"}]"#, "_id"), None);
        assert_eq!(named_id(b"not json", "_id"), None);
    }
}
