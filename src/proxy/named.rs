//! Writes that name their document in the body, not the path: CouchDB's `POST /{db}` with an
//! `_id` (nano's `db.insert(doc)`, CouchDB-Python's `db.save(doc)`) creates or updates that
//! document as its `PUT /{db}/{id}` does. Such a `POST`, when the `PUT` is a write route's,
//! is taken through the write pipeline as that `PUT`, not past the lock.

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Uri};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use super::error::{EdgeError, Refusal};
use super::request::{self, read_whole};
use crate::http::Body;
use crate::routes::{Captures, Dialect, Route, Routes};

/// What a document id is written as in a path: everything but letters, digits, `-`, `_` and
/// `~` escaped (`/` as `%2F`: a character of the id, not a segment).
const ID: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'~');

/// `req` as the `PUT` of the document its body names, when that `PUT` is a write route's;
/// else `req` as it came (its body read, when it had to be looked at). A refusal (a body too
/// large or too slow to look at, one that is not a JSON object in UTF-8, a path the stores
/// read two ways)
/// is answered in the dialect of the routes that made the body worth reading.
pub async fn as_document_write(
    routes: &Routes,
    req: Request<Body>,
    limits: request::Limits,
) -> Result<Request<Body>, (&'static Dialect, Refusal)> {
    if req.method() == Method::PUT {
        return put_naming_another(routes, req, limits).await;
    }
    let Some((field, dialect)) = worth_reading(routes, &req) else {
        return Ok(req);
    };
    // The limit of a whole document's `PUT`: a body this POST stands for.
    let max = limits.body.max(limits.document);
    let (mut parts, bytes, doc) = read_object(req, max).await.map_err(|r| (dialect, r))?;
    let doc = serde_json::Value::Object(doc);
    // No id (the store makes one up: a new document, no other writer's), a document no write
    // route names: passed on as it came.
    let path = parts.uri.path();
    let collection = path.strip_suffix('/').unwrap_or(path);
    match document_route(routes, collection, parts.uri.query(), &parts.headers, &doc, field) {
        Ok(Some(named)) => {
            tracing::debug!(uri = %named.uri, "a POST naming its document in its body: written as the PUT of that document");
            parts.method = Method::PUT;
            parts.uri = named.uri;
            Ok(Request::from_parts(parts, crate::http::full(bytes)))
        }
        Ok(None) => Ok(Request::from_parts(parts, crate::http::full(bytes))),
        Err(ambiguous) => Err((dialect, EdgeError::AmbiguousPath(ambiguous).into())),
    }
}

/// A `PUT` forwarded untouched (a database's own resource, `_local/…`, `_design/…`, an
/// attachment) that names a write route's document otherwise than by its path: pouchdb-server
/// writes the document its JSON body's `_id`, or else its `?id=`, names, ahead of the path's
/// (`PUT /db/_local/x` with `{"_id": "s1"}` writes `s1`). Refused, not written past the lock;
/// any other is passed on (its body read when it is JSON the store reads).
async fn put_naming_another(
    routes: &Routes,
    req: Request<Body>,
    limits: request::Limits,
) -> Result<Request<Body>, (&'static Dialect, Refusal)> {
    let Some((field, dialect)) = routes.named_in_body() else {
        return Ok(req);
    };
    match routes.find(req.method(), req.uri().path()) {
        Ok(Some((route, captures)))
            if !route
                .dialect
                .not_a_write(req.method(), req.uri(), req.headers(), &captures.session) =>
        {
            return Ok(req)
        }
        _ => {}
    }
    let db = req
        .uri()
        .path()
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or_default();
    let collection = format!("/{db}");
    let names_a_session = |id: &str| {
        let doc = serde_json::Value::Object(serde_json::Map::from_iter([(
            field.to_owned(),
            serde_json::Value::String(id.to_owned()),
        )]));
        !matches!(
            document_route(routes, &collection, None, &http::HeaderMap::new(), &doc, field),
            Ok(None)
        )
    };
    let refused = |message: String| {
        (
            dialect,
            Refusal::from(EdgeError::Invalid {
                code: "id_elsewhere",
                message,
            }),
        )
    };
    let named = |id: &str| {
        refused(format!(
            "this PUT names the document {id:?} otherwise than by its path, and the store writes that \
             document: send its write to its own path"
        ))
    };
    let by_query = req
        .uri()
        .query()
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_encoding::percent_decode_str(name).decode_utf8_lossy() == "id").then(|| {
                percent_encoding::percent_decode_str(value)
                    .decode_utf8_lossy()
                    .into_owned()
            })
        });
    if let Some(id) = by_query.filter(|id| names_a_session(id)) {
        return Err(named(&id));
    }
    // A document and its attachments as one body (`multipart/related`): the store writes the
    // document its JSON part names. Not read here: refused where a document is named.
    let document = req
        .uri()
        .path()
        .trim_start_matches('/')
        .split('/')
        .nth(1)
        .is_some_and(|n| !n.is_empty());
    let multipart = req.headers().get_all(header::CONTENT_TYPE).iter().any(|v| {
        v.as_bytes()
            .trim_ascii_start()
            .get(..10)
            .is_some_and(|m| m.eq_ignore_ascii_case(b"multipart/"))
    });
    if multipart && document {
        return Err(refused(
            "a multipart PUT writes the document its JSON part names, which may be a session's: send it \
             to the store itself"
                .to_owned(),
        ));
    }
    // The store reads a body's `_id` only from JSON it parses: typed `application/json`.
    let json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"));
    // A database's own `PUT` (`PUT /db`, its creation) and an empty body name no document.
    if !json || !document || http_body::Body::is_end_stream(req.body()) {
        return Ok(req);
    }
    let (parts, bytes, doc) = read_object(req, limits.body.max(limits.document))
        .await
        .map_err(|r| (dialect, r))?;
    if let Some(serde_json::Value::String(id)) = doc.get(field) {
        if names_a_session(id) {
            return Err(named(id));
        }
    }
    Ok(Request::from_parts(parts, crate::http::full(bytes)))
}

/// A body that may name a session's document, read whole as a JSON object in UTF-8, with
/// `parts` stating its length (it may have come chunked). Refused rather than passed on unread
/// when it is coded (the store would decode it), larger than `max`, too slow, in another
/// character set, or not a JSON object to turnlock: the store's reader may take what
/// turnlock's refuses (a byte order mark, UTF-16, a lone surrogate, a number out of range,
/// deep nesting) and find a session's document in it.
pub async fn read_object(
    req: Request<Body>,
    max: usize,
) -> Result<(http::request::Parts, Bytes, serde_json::Map<String, serde_json::Value>), Refusal> {
    if coded(req.headers()) {
        return Err(EdgeError::Invalid {
            code: "unsupported_content_encoding",
            message: "this request may write a session's document, so turnlock reads its body: send it \
                      without Content-Encoding"
                .into(),
        }
        .into());
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(EdgeError::BodyTooLarge { limit: max }.into());
    }
    let (mut parts, body) = req.into_parts();
    let bytes = read_whole(body, max).await?;
    state_length(&mut parts.headers, bytes.len());
    request::check_charset(&parts.headers)?;
    let doc = request::parse_object(&bytes)?;
    Ok((parts, bytes, doc))
}

/// States a body's length, read whole, in place of any chunked framing it came with.
pub fn state_length(headers: &mut http::HeaderMap, len: usize) {
    headers.remove(header::TRANSFER_ENCODING);
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
}

/// The last name of a path (before one trailing `/`), percent-decoded as CouchDB reads it.
pub fn last_name(path: &str) -> std::borrow::Cow<'_, str> {
    let last = path
        .strip_suffix('/')
        .unwrap_or(path)
        .rsplit('/')
        .next()
        .unwrap_or_default();
    percent_encoding::percent_decode_str(last).decode_utf8_lossy()
}

/// Whether a body comes coded (a `Content-Encoding` other than `identity`).
pub fn coded(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))
}

/// A document a write route names, by its id.
pub struct Named<'r> {
    pub id: String,
    pub route: &'r Route,
    pub captures: Captures,
    /// Its `PUT`'s target: `{collection}/{id}`, the id escaped, and the request's query.
    pub uri: Uri,
}

/// The write route whose `PUT` writes `doc`, named by its `field`, in `collection` (a path):
/// none when it names no document or no write route's; a refusal's message when the path is
/// one the stores read two ways.
pub fn document_route<'r>(
    routes: &'r Routes,
    collection: &str,
    query: Option<&str>,
    headers: &http::HeaderMap,
    doc: &serde_json::Value,
    field: &str,
) -> Result<Option<Named<'r>>, String> {
    let id = match doc.get(field) {
        Some(serde_json::Value::String(id)) if !id.is_empty() => id,
        _ => return Ok(None),
    };
    let mut target = format!("{collection}/{}", utf8_percent_encode(id, ID));
    if let Some(query) = query {
        target.push('?');
        target.push_str(query);
    }
    let Ok(uri) = target.parse::<Uri>() else {
        return Ok(None);
    };
    match routes.find(&Method::PUT, uri.path()) {
        Ok(Some((route, captures)))
            if route.dialect.named_in_body == Some(field)
                && !route
                    .dialect
                    .not_a_write(&Method::PUT, &uri, headers, &captures.session) =>
        {
            Ok(Some(Named {
                id: id.clone(),
                route,
                captures,
                uri,
            }))
        }
        Ok(_) => Ok(None),
        Err(ambiguous) => Err(ambiguous.to_string()),
    }
}

/// The field naming the document, and the dialect it belongs to, when `req` is a `POST` whose
/// body may name a write route's document: not one the routes name themselves, not to a
/// database's own resource (a name after the first starting with `_`: `_bulk_docs`, `_find`,
/// `_design/…/_update/…`), and not a multipart upload (an attachment's form).
fn worth_reading(routes: &Routes, req: &Request<Body>) -> Option<(&'static str, &'static Dialect)> {
    if req.method() != Method::POST {
        return None;
    }
    let (field, dialect) = routes.named_in_body()?;
    if !matches!(routes.find(req.method(), req.uri().path()), Ok(None)) {
        return None;
    }
    let resource = req.uri().path().trim_start_matches('/').split('/').skip(1).any(|name| {
        percent_encoding::percent_decode_str(name)
            .decode_utf8_lossy()
            .starts_with('_')
    });
    if resource {
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
    fn only_a_non_empty_string_id_names_a_write_routes_document() {
        let routes = crate::routes::Routes::from_toml(
            "[store]\ndialect = \"couchdb\"\n[[route]]\nmethod = \"PUT\"\npath = \"/{db}/{session}\"\nmode = \"merge\"\nkind = \"put\"\nturn = { body = \"/turn\", optional = true }\n",
            "/v1/sessions/",
        )
        .expect("routes");
        let named = |collection: &str, doc: serde_json::Value| {
            document_route(&routes, collection, None, &http::HeaderMap::new(), &doc, "_id")
                .map(|n| n.map(|n| (n.id, n.uri.to_string())))
        };
        let s1 = Some(("s-1".to_owned(), "/db/s-1".to_owned()));
        assert_eq!(named("/db", serde_json::json!({"_id": "s-1", "messages": []})), Ok(s1));
        assert_eq!(named("/db", serde_json::json!({"messages": []})), Ok(None));
        assert_eq!(named("/db", serde_json::json!({"_id": ""})), Ok(None));
        assert_eq!(named("/db", serde_json::json!({"_id": 7})), Ok(None));
        assert_eq!(named("/db", serde_json::json!([{"_id": "s-1"}])), Ok(None));
        // The database's own resources are not sessions' documents.
        assert_eq!(named("/db", serde_json::json!({"_id": "_design/v"})), Ok(None));
        assert!(
            named("//db", serde_json::json!({"_id": "d"})).is_err(),
            "an empty segment is read two ways"
        );
    }
}
