//! The edge of the write path: turns an HTTP request into a validated [`WriteRequest`], or a
//! clear 4xx. Nothing here touches the lock or the store.

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Method, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::http::{error, version_from_etag, Body};
use crate::merge::{validate_messages, Op};
use crate::routes::{Kind, Mode, Route, TurnSource};
use crate::session::{resolve_turn, turn_from_header, turn_from_json, SessionId, TurnError};

pub const SESSION_TURN: &str = "x-session-turn";
pub const CONTEXT_REPLACE: &str = "x-context-replace";
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;
/// How long a client may take to send a write's body: a trickling client is cut off with 408.
pub const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A write that passed every check that needs no lock.
#[derive(Debug)]
pub struct WriteRequest {
    pub session: SessionId,
    pub turn: u64,
    pub route: &'static str,
    pub action: Action,
    pub idempotency: Option<Idempotency>,
}

#[derive(Debug)]
pub enum Action {
    /// Read-merge-write of the document at `document` (a path on the store).
    Merge { op: Op, document: String },
    /// Forward this request unchanged, under the lock.
    Serialize {
        method: Method,
        path_and_query: String,
        headers: HeaderMap,
        body: Bytes,
    },
}

#[derive(Clone, Debug)]
pub struct Idempotency {
    /// SHA-256 of the client's key (the record's key is built from it).
    pub key_digest: String,
    /// SHA-256 of what the request asks for: a reuse with another payload is refused.
    pub fingerprint: String,
}

/// A request refused at the edge, before any lock: a status, a specific error code, and a
/// message saying what to fix.
#[derive(Debug)]
pub struct Refusal {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub extra: Option<Value>,
}

impl Refusal {
    fn new(status: StatusCode, code: &'static str, message: impl std::fmt::Display) -> Self {
        Self {
            status,
            code,
            message: message.to_string(),
            extra: None,
        }
    }

    pub fn into_response(self) -> http::Response<Body> {
        error(self.status, self.code, self.message, self.extra)
    }
}

fn bad(code: &'static str, message: impl std::fmt::Display) -> Refusal {
    Refusal::new(StatusCode::BAD_REQUEST, code, message)
}

/// Parses and validates a write. `max_body` bounds the body, declared or streamed.
pub async fn parse(
    route: &Route,
    raw_session: &str,
    parts: &http::request::Parts,
    body: Incoming,
    max_body: usize,
) -> Result<WriteRequest, Refusal> {
    let session = SessionId::parse(raw_session).map_err(|e| bad("invalid_session_id", e))?;
    let idempotency_key = match parts.headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(v) if !v.is_empty() && v.len() <= MAX_IDEMPOTENCY_KEY_LEN => Some(v.as_bytes().to_vec()),
        Some(_) => {
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
    let json_body = matches!(route.mode, Mode::Merge { .. }) || matches!(route.turn, TurnSource::Body(_));
    if json_body {
        check_content_type(&parts.headers)?;
    }
    let bytes = match tokio::time::timeout(BODY_READ_TIMEOUT, Limited::new(body, max_body).collect()).await {
        Err(_) => {
            return Err(Refusal::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                format!("the body was not received within {} s", BODY_READ_TIMEOUT.as_secs()),
            ))
        }
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            return Err(too_large(max_body))
        }
        Ok(Err(e)) => return Err(bad("body_read_failed", format!("could not read the request body: {e}"))),
    };
    let header_turn = match parts.headers.get(SESSION_TURN) {
        Some(v) => Some(turn_from_header(v.as_bytes()).map_err(turn_refusal)?),
        None => None,
    };
    let fingerprint = |extra: &[u8]| {
        let mut h = Sha256::new();
        h.update(parts.method.as_str());
        h.update([0]);
        h.update(parts.uri.path());
        h.update([0]);
        h.update(extra);
        h.update([0]);
        h.update(&bytes);
        hex(&h.finalize())
    };
    let (turn, action, fp) = match &route.mode {
        Mode::Serialize => {
            let turn = match &route.turn {
                TurnSource::Header(name) => match parts.headers.get(name) {
                    Some(v) => {
                        let turn = turn_from_header(v.as_bytes()).map_err(turn_refusal)?;
                        check_header_turns(name, turn, header_turn)?;
                        turn
                    }
                    None => return Err(turn_refusal(TurnError::Missing)),
                },
                TurnSource::Body(pointer) => {
                    let doc = parse_object(&bytes)?;
                    let body_turn = Value::Object(doc)
                        .pointer(pointer)
                        .map(turn_from_json)
                        .transpose()
                        .map_err(turn_refusal)?;
                    resolve_turn(body_turn, header_turn).map_err(turn_refusal)?
                }
            };
            let action = Action::Serialize {
                method: parts.method.clone(),
                path_and_query: parts
                    .uri
                    .path_and_query()
                    .map(|p| p.as_str().to_owned())
                    .unwrap_or_else(|| "/".into()),
                headers: parts.headers.clone(),
                body: bytes.clone(),
            };
            (turn, action, fingerprint(b"serialize"))
        }
        Mode::Merge { kind, document } => {
            let mut doc = parse_object(&bytes)?;
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
            let turn = resolve_turn(body_turn, header_turn).map_err(turn_refusal)?;
            let replace = parts
                .headers
                .get(CONTEXT_REPLACE)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
            let if_match = parts.headers.get(header::IF_MATCH);
            let op = build_op(*kind, doc, replace, if_match)?;
            let tag: &[u8] = if replace { b"replace" } else { b"merge" };
            (
                turn,
                Action::Merge {
                    op,
                    document: document.render(session.as_str()),
                },
                fingerprint(tag),
            )
        }
    };
    let idempotency = idempotency_key.map(|k| Idempotency {
        key_digest: hex(&Sha256::digest(&k)),
        fingerprint: fp,
    });
    Ok(WriteRequest {
        session,
        turn,
        route: route.name,
        action,
        idempotency,
    })
}

fn build_op(
    kind: Kind,
    mut doc: Map<String, Value>,
    replace: bool,
    if_match: Option<&http::HeaderValue>,
) -> Result<Op, Refusal> {
    let parsed_if_match = match if_match {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(version_from_etag)
                .ok_or_else(|| bad("invalid_if_match", "If-Match must hold the version read, e.g. \"12\""))?,
        ),
    };
    Ok(match kind {
        Kind::Append => {
            let messages = doc.remove("messages").ok_or_else(|| {
                bad(
                    "invalid_messages",
                    "an append needs `messages`: an array of message objects",
                )
            })?;
            Op::Append {
                messages: validate_messages(&messages).map_err(|m| bad("invalid_messages", m))?,
            }
        }
        Kind::Patch => {
            if let Some(field) = ["messages", "session", "version"]
                .into_iter()
                .find(|f| doc.contains_key(*f))
            {
                return Err(bad(
                    "forbidden_field",
                    format!("a patch cannot set `{field}`; append messages with POST …/messages"),
                ));
            }
            Op::Patch { patch: doc }
        }
        Kind::Put if replace => {
            let Some(if_match) = parsed_if_match else {
                return Err(Refusal::new(
                    StatusCode::PRECONDITION_REQUIRED,
                    "precondition_required",
                    "a replacement (X-Context-Replace: true) needs If-Match with the version read",
                ));
            };
            check_messages_field(&doc)?;
            Op::Replace { doc, if_match }
        }
        Kind::Put => {
            check_messages_field(&doc)?;
            let body_version = match doc.get("version") {
                None => None,
                Some(v) => Some(
                    v.as_u64()
                        .ok_or_else(|| bad("invalid_version", "`version` must be a non-negative integer"))?,
                ),
            };
            let base_version = match (body_version, parsed_if_match) {
                (Some(b), Some(h)) if b != h => {
                    return Err(bad(
                        "version_mismatch",
                        format!("body version {b} and If-Match {h} disagree"),
                    ))
                }
                (Some(v), _) | (None, Some(v)) => v,
                (None, None) => 0,
            };
            Op::Put { doc, base_version }
        }
        Kind::Compact => {
            let through = match doc.remove("through") {
                Some(Value::String(s)) if !s.is_empty() => s,
                _ => {
                    return Err(bad(
                        "invalid_through",
                        "a compaction needs `through`: the id of the last message it summarizes",
                    ))
                }
            };
            Op::Compact {
                through,
                summary: doc.remove("summary").unwrap_or(Value::Null),
            }
        }
    })
}

fn check_messages_field(doc: &Map<String, Value>) -> Result<(), Refusal> {
    match doc.get("messages") {
        None => Ok(()),
        Some(m) => validate_messages(m).map(|_| ()).map_err(|e| bad("invalid_messages", e)),
    }
}

fn check_content_type(headers: &HeaderMap) -> Result<(), Refusal> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    if mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json")) {
        Ok(())
    } else {
        Err(Refusal::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!("writes must be JSON (application/json or application/merge-patch+json), not {ct:?}"),
        ))
    }
}

fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, Refusal> {
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

fn too_large(max: usize) -> Refusal {
    Refusal {
        extra: Some(serde_json::json!({"limit": max})),
        ..Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the body is larger than the limit of {max} bytes"),
        )
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
