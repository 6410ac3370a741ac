//! The edge of the write path: turns an HTTP request into a validated [`WriteRequest`], or a
//! clear 4xx. Nothing here touches the lock or the store.

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::Method;
use http_body_util::BodyExt;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::merge::{assign_ids, canonical, KeyedIds, Op};
use crate::routes::{AnswerForm, Captures, Kind, Mode, Route, TurnSource, VersionAt};
use crate::session::{resolve_turn, turn_from_header, turn_from_json, SessionId, TurnError};
use crate::upstream::StoreParts;

mod op;

use self::op::build_op;

pub const SESSION_TURN: &str = "x-session-turn";
pub const CONTEXT_REPLACE: &str = "x-context-replace";
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Whether an `Idempotency-Key` is one turnlock takes: 1 to 255 bytes.
pub fn valid_idempotency_key(key: &http::HeaderValue) -> bool {
    !key.is_empty() && key.len() <= MAX_IDEMPOTENCY_KEY_LEN
}

/// The idempotency key of one entry of a bulk write, in its request's extensions: the bulk
/// request's key and the entry's place, joined by a byte no header value holds, so that no
/// single write's `Idempotency-Key` names the same record.
#[derive(Clone, Debug)]
pub struct EntryKey(pub Vec<u8>);

impl EntryKey {
    pub fn of(key: &[u8], index: usize) -> Self {
        let mut own = key.to_vec();
        own.push(0);
        own.extend_from_slice(index.to_string().as_bytes());
        Self(own)
    }
}
/// A shorter wait deadline for one write, in milliseconds (never longer than the configured one).
pub const WAIT_DEADLINE: &str = "x-wait-deadline-ms";
/// Longest wait a request may ask for (a longer one is cut to the configured deadline anyway).
const MAX_WAIT_DEADLINE_MS: u64 = 600_000;
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;
/// How long a client may take to send a write's body: a trickling client is cut off with 408.
pub const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A write that passed every check that needs no lock.
#[derive(Debug)]
pub struct WriteRequest {
    pub session: SessionId,
    pub turn: u64,
    /// Whether the write named its turn; one that did not (a route whose turn is optional) is
    /// merged at the stored turn, with no stale-turn check.
    pub turn_given: bool,
    pub route: &'static str,
    pub action: Action,
    pub idempotency: Option<Idempotency>,
    /// The wait the request asked for with `X-Wait-Deadline-Ms`, if any.
    pub wait: Option<std::time::Duration>,
}

#[derive(Debug)]
pub enum Action {
    /// Read-merge-write of the document at `document` (a path on the store).
    Merge {
        op: Op,
        document: String,
        /// What the store needs of the client's request on the write-back (its dialect's).
        store: StoreParts,
    },
    /// Delete the document at `document` (a path on the store), in its commit order, with
    /// the client's headers (credentials, preconditions) and query string (CouchDB's `rev`).
    Delete {
        document: String,
        query: Option<String>,
        headers: HeaderMap,
        /// How the document is read back, when the store answers 404 (see [`StoreParts`]).
        store: StoreParts,
    },
    /// Forward this request unchanged, under the lock.
    Serialize {
        /// The resource the write protects: the route's path for this session, the same
        /// whichever spelling of it the client sent.
        resource: String,
        method: Method,
        path_and_query: String,
        headers: HeaderMap,
        body: Bytes,
        /// An object created once: the rewrite rule checked against the stored object.
        once: Option<Once>,
    },
}

/// A `serialize` write of an object created once (one object per message): created with
/// `If-None-Match: *`; a stored object is rewritten only when `same` (JSON pointers) hold the
/// same values in it and in the write, under `If-Match` with the ETag read.
#[derive(Debug)]
pub struct Once {
    pub same: Vec<String>,
    /// The client's credentials for turnlock's read of the stored object.
    pub store: StoreParts,
}

#[derive(Clone, Debug)]
pub struct Idempotency {
    /// SHA-256 of the client's key (the record's key is built from it).
    pub key_digest: String,
    /// SHA-256 of what the request asks for: a reuse with another payload is refused.
    pub fingerprint: String,
}

use super::error::EdgeError;
pub use super::error::Refusal;

/// A request that does not make a valid write: `code` names what to fix.
fn bad(code: &'static str, message: impl std::fmt::Display) -> Refusal {
    Refusal::from(EdgeError::Invalid {
        code,
        message: message.to_string(),
    })
}

/// The size limits of a write's body.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Any write body.
    pub body: usize,
    /// A merged or replacing `PUT`, whose body is a whole document: a document the store
    /// served can be written back.
    pub document: usize,
}

/// Reads a whole body of at most `max` bytes: `Err(None)` when it is larger, `Err(Some(..))`
/// when reading failed.
pub(super) async fn read_limited(
    mut body: crate::http::Body,
    max: usize,
) -> Result<bytes::Bytes, Option<crate::http::BoxError>> {
    let mut buf = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.map_err(Some)?.into_data() {
            if buf.len() + data.len() > max {
                return Err(None);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf.freeze())
}

/// A whole body of at most `max` bytes, received within [`BODY_READ_TIMEOUT`].
pub(super) async fn read_whole(body: crate::http::Body, max: usize) -> Result<bytes::Bytes, EdgeError> {
    match tokio::time::timeout(BODY_READ_TIMEOUT, read_limited(body, max)).await {
        Err(_) => Err(EdgeError::BodyTimeout(BODY_READ_TIMEOUT)),
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(None)) => Err(EdgeError::BodyTooLarge { limit: max }),
        Ok(Err(Some(e))) => Err(EdgeError::Invalid {
            code: "body_read_failed",
            message: format!("could not read the request body: {e}"),
        }),
    }
}

/// Parses and validates a write. `limits` bound the body, declared or streamed.
pub async fn parse(
    route: &Route,
    captures: &Captures,
    parts: &http::request::Parts,
    body: crate::http::Body,
    limits: Limits,
) -> Result<WriteRequest, Refusal> {
    let max_body = match route.mode {
        Mode::Merge { kind: Kind::Put, .. } => limits.body.max(limits.document),
        _ => limits.body,
    };
    let key = if route.path.has_params() {
        captures.session_key_within(route.session_scope.as_deref())
    } else {
        captures.session.clone()
    };
    // The canonical API's ids are checked; a store's own route takes the store's names as
    // they are (the document path is rendered from the request's own spelling).
    let session = if route.strict_content_type {
        SessionId::parse(&key).map_err(|e| bad("invalid_session_id", e))?
    } else {
        SessionId::of_store_name(&crate::routes::canonical_name(&key))
    };
    let wait = wait_deadline(&parts.headers)?;
    if let Mode::Merge {
        kind: Kind::Delete,
        document,
    } = &route.mode
    {
        // A delete carries no turn and no body: it is ordered by the document's commit slot.
        return Ok(WriteRequest {
            turn: 0,
            turn_given: true,
            route: route.name,
            action: Action::Delete {
                document: document.render_with(captures),
                query: parts.uri.query().map(str::to_owned),
                headers: parts.headers.clone(),
                store: StoreParts::of(route.dialect, &parts.headers),
            },
            idempotency: None,
            wait,
            session,
        });
    }
    let idempotency_key = match (parts.extensions.get::<EntryKey>(), parts.headers.get(IDEMPOTENCY_KEY)) {
        // The bulk write's key, checked as this one would be.
        (Some(EntryKey(own)), _) => Some(own.clone()),
        (None, None) => None,
        (None, Some(v)) if valid_idempotency_key(v) => Some(v.as_bytes().to_vec()),
        (None, Some(_)) => {
            return Err(bad(
                "invalid_idempotency_key",
                format!("Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} bytes"),
            ))
        }
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_body as u64) {
        return Err(too_large(max_body));
    }
    let json_body =
        matches!(route.mode, Mode::Merge { .. }) || matches!(route.turn, TurnSource::Body(_)) || route.once.is_some();
    if json_body {
        check_content_type(&parts.headers, route.strict_content_type)?;
    }
    let bytes = read_whole(body, max_body).await?;
    // A turn header sent twice could be read as one value here and as the other by the store.
    let route_turn_header = match &route.turn {
        TurnSource::Header(name) => Some(name.as_str()),
        TurnSource::Body(_) => None,
    };
    for name in std::iter::once(SESSION_TURN).chain(route_turn_header) {
        if parts.headers.get_all(name).iter().nth(1).is_some() {
            return Err(bad(
                "invalid_turn",
                format!("`{name}` appears more than once; send one turn"),
            ));
        }
    }
    let header_turn = match parts.headers.get(SESSION_TURN) {
        Some(v) => Some(turn_from_header(v.as_bytes()).map_err(turn_refusal)?),
        None => None,
    };
    let fingerprint = |extra: &[u8], json: bool| {
        let mut h = Sha256::new();
        h.update(parts.method.as_str());
        h.update([0]);
        h.update(parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"));
        h.update([0]);
        h.update(extra);
        // What else changes the request's meaning: the turn and precondition headers.
        for name in [SESSION_TURN, header::IF_MATCH.as_str(), CONTEXT_REPLACE] {
            h.update([0]);
            if let Some(v) = parts.headers.get(name) {
                h.update(v.as_bytes());
            }
        }
        h.update([0]);
        // A JSON body is compared as JSON: the order of its keys does not matter.
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(v) if json => {
                let mut out = Vec::with_capacity(bytes.len());
                canonical(&v, &mut out);
                h.update(&out);
            }
            _ => h.update(&bytes),
        }
        hex(&h.finalize())
    };
    let ((turn, turn_given), action, fp) = match &route.mode {
        Mode::Serialize => {
            let turn = match &route.turn {
                TurnSource::Header(name) => match parts.headers.get(name) {
                    Some(v) => {
                        let turn = turn_from_header(v.as_bytes()).map_err(turn_refusal)?;
                        check_header_turns(name, turn, header_turn)?;
                        Ok(turn)
                    }
                    None => Err(TurnError::Missing),
                },
                TurnSource::Body(pointer) => {
                    let doc = parse_object(&bytes)?;
                    let body_turn = Value::Object(doc)
                        .pointer(pointer)
                        .map(turn_from_json)
                        .transpose()
                        .map_err(turn_refusal)?;
                    resolve_turn(body_turn, header_turn)
                }
            };
            // A write without a turn on a route whose turn is optional: serialized with the
            // session's writes, not stale-checked.
            let (turn, turn_given) = match turn {
                Ok(t) => (t, true),
                Err(TurnError::Missing) if route.turn_optional => (0, false),
                Err(e) => return Err(turn_refusal(e)),
            };
            let once = match &route.once {
                Some(same) => {
                    parse_object(&bytes)?;
                    Some(Once {
                        same: same.clone(),
                        store: StoreParts::of(route.dialect, &parts.headers),
                    })
                }
                None => None,
            };
            let action = Action::Serialize {
                resource: route.path.render_with(captures),
                method: parts.method.clone(),
                path_and_query: parts
                    .uri
                    .path_and_query()
                    .map(|p| p.as_str().to_owned())
                    .unwrap_or_else(|| "/".into()),
                headers: parts.headers.clone(),
                body: bytes.clone(),
                once,
            };
            // The payload is hashed only for an idempotency record.
            let fp = idempotency_key.is_some().then(|| fingerprint(b"serialize", json_body));
            ((turn, turn_given), action, fp)
        }
        Mode::Merge { kind, document } => {
            let mut doc = parse_object(&bytes)?;
            check_deletion(route.dialect, &doc)?;
            // The revision a copy names in its query (CouchDB's `?rev=`), which the store takes
            // when the body names none: the copy's base, as a `_rev` in its body is.
            if let VersionAt::BodyField(field) = route.dialect.version {
                let named = form_urlencoded::parse(parts.uri.query().unwrap_or_default().as_bytes())
                    .find(|(name, _)| name == field.trim_start_matches('_'))
                    .map(|(_, rev)| rev.into_owned());
                if let (false, Some(rev)) = (doc.contains_key(field), named) {
                    doc.insert(field.to_owned(), Value::String(rev));
                }
            }
            let body_turn = match &route.turn {
                TurnSource::Body(pointer) if pointer == "/turn" => {
                    doc.remove("turn").map(|v| turn_from_json(&v)).transpose()
                }
                TurnSource::Body(pointer) => Value::Object(doc.clone())
                    .pointer(pointer)
                    .map(turn_from_json)
                    .transpose(),
                TurnSource::Header(name) => parts
                    .headers
                    .get(name)
                    .map(|v| turn_from_header(v.as_bytes()))
                    .transpose(),
            }
            .map_err(turn_refusal)?;
            if let (TurnSource::Header(name), Some(t)) = (&route.turn, body_turn) {
                check_header_turns(name, t, header_turn)?;
            }
            let (turn, turn_given) = match resolve_turn(body_turn, header_turn) {
                Ok(t) => (t, true),
                Err(TurnError::Missing) if route.turn_optional => (0, false),
                Err(e) => return Err(turn_refusal(e)),
            };
            let replace = parts
                .headers
                .get(CONTEXT_REPLACE)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
            let store = StoreParts::of(route.dialect, &parts.headers);
            // A store's own entity tag is the store's to compare (under the lock), not a
            // turnlock version.
            let if_match = match route.dialect.answer {
                AnswerForm::Turnlock => parts.headers.get(header::IF_MATCH),
                _ => None,
            };
            let allowed = turn_field(&route.turn);
            let mut op = build_op(*kind, doc, replace, if_match, allowed.as_deref())?;
            let tag: &[u8] = if replace { b"replace" } else { b"merge" };
            // The payload is hashed only for an idempotency record.
            let fp = idempotency_key.is_some().then(|| fingerprint(tag, true));
            if let (Some(key), Some(fp), Op::Append { messages }) = (&idempotency_key, &fp, &mut op) {
                // A retry of this request (same key, same payload) gets the same ids, so
                // de-duplication absorbs it even when the first attempt's outcome was unknown.
                assign_ids(
                    messages,
                    &mut KeyedIds::new(&format!("{}:{fp}", hex(&Sha256::digest(key)))),
                );
            }
            (
                (turn, turn_given),
                Action::Merge {
                    op,
                    document: document.render_with(captures),
                    store,
                },
                fp,
            )
        }
    };
    let idempotency = idempotency_key.zip(fp).map(|(k, fp)| Idempotency {
        key_digest: hex(&Sha256::digest(&k)),
        fingerprint: fp,
    });
    Ok(WriteRequest {
        session,
        turn,
        turn_given,
        route: route.name,
        action,
        idempotency,
        wait,
    })
}

/// The wait deadline a request asks for: whole milliseconds, at least 1.
fn wait_deadline(headers: &HeaderMap) -> Result<Option<std::time::Duration>, Refusal> {
    let Some(v) = headers.get(WAIT_DEADLINE) else {
        return Ok(None);
    };
    match v.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        Some(ms) if (1..=MAX_WAIT_DEADLINE_MS).contains(&ms) => Ok(Some(std::time::Duration::from_millis(ms))),
        _ => Err(bad(
            "invalid_wait_deadline",
            format!("X-Wait-Deadline-Ms must be whole milliseconds from 1 to {MAX_WAIT_DEADLINE_MS}"),
        )),
    }
}

/// The top-level body field the turn is read from, if any.
fn turn_field(turn: &TurnSource) -> Option<String> {
    match turn {
        TurnSource::Body(pointer) => pointer
            .trim_start_matches('/')
            .split('/')
            .next()
            .filter(|s| !s.is_empty())
            .map(|s| s.replace("~1", "/").replace("~0", "~")),
        TurnSource::Header(_) => None,
    }
}

/// A JSON body is declared JSON; on a store's own route (not `strict`) it may also come as
/// object-store SDKs send any body: `application/octet-stream`, `binary/octet-stream` or untyped.
/// A body field that would make a merged write the document's deletion at the store
/// (CouchDB's `_deleted`): refused, as a session's document is deleted by its `DELETE`,
/// ordered with the writes.
pub(super) fn check_deletion(dialect: &crate::routes::Dialect, doc: &Map<String, Value>) -> Result<(), Refusal> {
    match dialect.deleting_field.and_then(|f| Some((f, doc.get(f)?))) {
        Some((field, v)) if *v != Value::Bool(false) && !v.is_null() => Err(bad(
            "forbidden_field",
            format!("`{field}` would delete the session's document past its lock: send its DELETE"),
        )),
        _ => Ok(()),
    }
}

/// A body said to be in a character set other than UTF-8 (JSON's, RFC 8259): refused, as the
/// store would read it in that set (pouchdb-server decodes `charset=utf-7`), and not as the
/// JSON turnlock read, merged and wrote back.
pub(super) fn check_charset(headers: &HeaderMap) -> Result<(), EdgeError> {
    for value in headers.get_all(header::CONTENT_TYPE) {
        let text = String::from_utf8_lossy(value.as_bytes());
        for param in text.split(';').skip(1) {
            let Some((name, charset)) = param.split_once('=') else {
                continue;
            };
            let charset = charset.trim().trim_matches('"');
            if name.trim().eq_ignore_ascii_case("charset")
                && !charset.eq_ignore_ascii_case("utf-8")
                && !charset.eq_ignore_ascii_case("utf8")
            {
                return Err(EdgeError::UnsupportedCharset(charset.to_owned()));
            }
        }
    }
    Ok(())
}

pub(super) fn check_content_type(headers: &HeaderMap, strict: bool) -> Result<(), Refusal> {
    check_charset(headers)?;
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let untyped = ["", "application/octet-stream", "binary/octet-stream"].contains(&mime.as_str());
    if mime == "application/json"
        || (mime.starts_with("application/") && mime.ends_with("+json"))
        || (!strict && untyped)
    {
        Ok(())
    } else {
        Err(EdgeError::UnsupportedMediaType(ct.to_owned()).into())
    }
}

pub(super) fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, Refusal> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(bad("invalid_body", "the body must be a JSON object")),
        Err(e) => Err(bad("malformed_json", format!("the body is not valid JSON: {e}"))),
    }
}

/// A route whose turn is in its own header refuses a disagreeing `X-Session-Turn`.
fn check_header_turns(name: &http::HeaderName, turn: u64, session_turn: Option<u64>) -> Result<(), Refusal> {
    match session_turn {
        Some(other) if other != turn => Err(bad(
            "turn_mismatch",
            format!("the {name} header ({turn}) and the X-Session-Turn header ({other}) disagree"),
        )),
        _ => Ok(()),
    }
}

fn turn_refusal(e: TurnError) -> Refusal {
    bad(e.code(), e)
}

fn too_large(limit: usize) -> Refusal {
    EdgeError::BodyTooLarge { limit }.into()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_turn_field_is_the_first_segment_of_its_pointer() {
        assert_eq!(turn_field(&TurnSource::Body("/turn".into())).as_deref(), Some("turn"));
        assert_eq!(
            turn_field(&TurnSource::Body("/meta/turn".into())).as_deref(),
            Some("meta")
        );
        assert_eq!(
            turn_field(&TurnSource::Header(http::HeaderName::from_static("x-turn"))),
            None
        );
    }
}
