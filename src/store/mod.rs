//! The reference context store: a plain JSON document store over HTTP.
//!
//! `GET`/`PUT`/`DELETE /v1/sessions/{id}`, `ETag` = version, `If-Match` and
//! `If-None-Match: *` honoured (412 on mismatch); a `PUT` with `Prefer: return=minimal` is
//! answered without the document (its version in the `ETag`). It is deliberately plain: a client that does
//! GET-modify-PUT without preconditions loses updates against it, exactly as against any
//! key-value or document store. Documents live in memory, or in Redis with `--redis`.

mod backend;

pub use self::backend::Backend;

use std::net::SocketAddr;
use std::time::Duration;

use crate::server::RequestBody;
use bytes::Bytes;
use clap::builder::BoolishValueParser;
use clap::Args;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{ConfigError, StartError};
use crate::http::{error, etag_for, full, version_from_etag, Body};

/// Path prefix of the session documents.
pub const SESSIONS: &str = "/v1/sessions/";
const MAX_ID_LEN: usize = 256;

/// `turnlock store`: every flag has an environment variable `TURNLOCK_<NAME>`.
#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    #[arg(long, env = "TURNLOCK_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Keep documents in Redis instead of memory.
    #[arg(long, env = "TURNLOCK_REDIS")]
    pub redis: Option<String>,
    #[arg(long, env = "TURNLOCK_KEY_PREFIX", default_value = "turnlock-store:")]
    pub key_prefix: String,
    #[arg(long, env = "TURNLOCK_MAX_BODY_BYTES", default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Behave like a store without conditional writes: no ETag, If-Match ignored.
    #[arg(long, env = "TURNLOCK_NO_ETAGS", value_parser = BoolishValueParser::new())]
    pub no_etags: bool,
    /// Refuse a write whose X-Fencing-Token is lower than one already stored for the document
    /// (409 stale_fencing_token): the store-side check that stops a paused lock holder even
    /// without conditional writes. Only with one shared Redis behind every proxy.
    #[arg(long, env = "TURNLOCK_ENFORCE_FENCING", value_parser = BoolishValueParser::new())]
    pub enforce_fencing: bool,
    #[arg(long, env = "TURNLOCK_SHUTDOWN_GRACE_MS", default_value_t = 5_000)]
    pub shutdown_grace_ms: u64,
}

impl StoreArgs {
    pub fn local() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            redis: None,
            key_prefix: "turnlock-store:".into(),
            max_body_bytes: 8 * 1024 * 1024,
            no_etags: false,
            enforce_fencing: false,
            shutdown_grace_ms: 5_000,
        }
    }
}

#[derive(Clone)]
pub struct Store {
    backend: Backend,
    etags: bool,
    enforce_fencing: bool,
    max_body: usize,
}

/// What a conditional write asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    Any,
    Absent,
    Version(u64),
    Exists,
}

#[derive(Debug, PartialEq, Eq)]
pub enum PutOutcome {
    Stored {
        version: u64,
        created: bool,
        body: Bytes,
    },
    PreconditionFailed,
    /// A write with a higher fencing token was already stored (with `--enforce-fencing`).
    Fenced {
        token: u64,
        highest: u64,
    },
}

/// A running store.
pub type RunningStore = crate::server::Serving;

pub async fn start(args: StoreArgs) -> Result<RunningStore, StartError> {
    let backend = match &args.redis {
        Some(url) => Backend::redis(url, &args.key_prefix).map_err(|e| ConfigError(e.to_string()))?,
        None => Backend::memory(),
    };
    let store = Store {
        backend,
        etags: !args.no_etags,
        enforce_fencing: args.enforce_fencing,
        max_body: args.max_body_bytes,
    };
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| StartError::bind(args.listen, e))?;
    let addr = listener.local_addr().map_err(|e| ConfigError(e.to_string()))?;
    let shutdown = CancellationToken::new();
    let grace = Duration::from_millis(args.shutdown_grace_ms);
    let task = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let handler = move |req, _peer| {
                let store = store.clone();
                async move { store.handle(req).await }
            };
            crate::server::serve(listener, handler, shutdown, grace).await;
        })
    };
    tracing::info!(%addr, etags = !args.no_etags, "turnlock reference store listening");
    Ok(RunningStore::new(addr, shutdown, task))
}

impl Store {
    async fn handle(&self, req: Request<RequestBody>) -> Response<Body> {
        let path = req.uri().path().to_owned();
        if path == "/healthz" || path == "/" {
            return crate::http::json(StatusCode::OK, &json!({"status": "ok"}));
        }
        let Some(id) = path
            .strip_prefix(SESSIONS)
            .filter(|id| !id.is_empty() && !id.contains('/'))
        else {
            return error(
                StatusCode::NOT_FOUND,
                "not_found",
                "documents live at /v1/sessions/{id}",
                None,
            );
        };
        if id.len() > MAX_ID_LEN {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_id",
                format!("ids are at most {MAX_ID_LEN} bytes"),
                None,
            );
        }
        let id = id.to_owned();
        let result = match *req.method() {
            Method::GET | Method::HEAD => {
                let if_none_match = req.headers().get(header::IF_NONE_MATCH).cloned();
                self.get(&id, if_none_match.as_ref()).await
            }
            Method::PUT => self.put(&id, req).await,
            Method::DELETE => self.delete(&id, &req).await,
            _ => Ok(error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "use GET, PUT or DELETE",
                None,
            )),
        };
        result.unwrap_or_else(|e| error(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable", e, None))
    }

    /// A document, or `304 Not Modified` when `If-None-Match` names its current entity tag
    /// (weak comparison, as RFC 9110 asks for GET).
    async fn get(
        &self,
        id: &str,
        if_none_match: Option<&HeaderValue>,
    ) -> Result<Response<Body>, backend::BackendError> {
        Ok(match self.backend.get(id).await? {
            None => error(StatusCode::NOT_FOUND, "not_found", "no such session", None),
            Some((version, _)) if self.etags && if_none_match.is_some_and(|v| none_match(v, version)) => {
                let mut res = Response::new(crate::http::empty());
                *res.status_mut() = StatusCode::NOT_MODIFIED;
                res.headers_mut().insert(header::ETAG, etag_for(version));
                res
            }
            Some((version, body)) => self.document(StatusCode::OK, version, body),
        })
    }

    async fn put(&self, id: &str, req: Request<RequestBody>) -> Result<Response<Body>, backend::BackendError> {
        let expect = if !self.etags {
            Expect::Any
        } else {
            match expectation(req.headers()) {
                Ok(e) => e,
                Err(m) => return Ok(error(StatusCode::BAD_REQUEST, "invalid_precondition", m, None)),
            }
        };
        let fence = match req.headers().get(&crate::upstream::FENCING_TOKEN) {
            Some(v) if self.enforce_fencing => match v.to_str().ok().and_then(|t| t.parse::<u64>().ok()) {
                Some(t) => Some(t),
                None => {
                    return Ok(error(
                        StatusCode::BAD_REQUEST,
                        "invalid_fencing_token",
                        "X-Fencing-Token must be a non-negative integer",
                        None,
                    ))
                }
            },
            _ => None,
        };
        let minimal = prefers_minimal(req.headers());
        let bytes = match Limited::new(req.into_body(), self.max_body).collect().await {
            Ok(c) => c.to_bytes(),
            Err(_) => {
                return Ok(error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    format!("documents are at most {} bytes", self.max_body),
                    None,
                ))
            }
        };
        // Checked once as a JSON object without parsing it into values: the store keeps the
        // bytes, and sets the version on them under its lock without parsing them again.
        let doc = match crate::merge::RawDocument::parse(&bytes) {
            Ok(doc) => doc,
            Err(crate::merge::NotADocument::NotAnObject) => {
                return Ok(error(
                    StatusCode::BAD_REQUEST,
                    "invalid_body",
                    "a document is a JSON object",
                    None,
                ))
            }
            Err(crate::merge::NotADocument::Malformed(e)) => {
                return Ok(error(StatusCode::BAD_REQUEST, "malformed_json", e, None))
            }
        };
        let outcome = self.backend.put(id, &doc, expect, fence).await?;
        drop(doc);
        Ok(match outcome {
            PutOutcome::Fenced { token, highest } => error(
                StatusCode::CONFLICT,
                "stale_fencing_token",
                format!("fencing token {token} is older than one already written"),
                Some(json!({"highest": highest})),
            ),
            PutOutcome::PreconditionFailed => error(
                StatusCode::PRECONDITION_FAILED,
                "precondition_failed",
                "the document changed",
                None,
            ),
            PutOutcome::Stored { version, created, body } => {
                let status = if created { StatusCode::CREATED } else { StatusCode::OK };
                if minimal {
                    // The version is in the entity tag; the document is not sent back.
                    let mut res = self.document(status, version, Bytes::new());
                    res.headers_mut().remove(header::CONTENT_TYPE);
                    res.headers_mut()
                        .insert(PREFERENCE_APPLIED, HeaderValue::from_static("return=minimal"));
                    res
                } else {
                    self.document(status, version, body)
                }
            }
        })
    }

    async fn delete(&self, id: &str, req: &Request<RequestBody>) -> Result<Response<Body>, backend::BackendError> {
        let expect = if self.etags {
            match expectation(req.headers()) {
                Ok(e) => e,
                Err(m) => return Ok(error(StatusCode::BAD_REQUEST, "invalid_precondition", m, None)),
            }
        } else {
            Expect::Any
        };
        Ok(match self.backend.delete(id, expect).await? {
            Some(true) => {
                let mut res = Response::new(crate::http::empty());
                *res.status_mut() = StatusCode::NO_CONTENT;
                res
            }
            Some(false) => error(
                StatusCode::PRECONDITION_FAILED,
                "precondition_failed",
                "the document changed",
                None,
            ),
            None => error(StatusCode::NOT_FOUND, "not_found", "no such session", None),
        })
    }

    fn document(&self, status: StatusCode, version: u64, body: Bytes) -> Response<Body> {
        let mut res = Response::new(full(body));
        *res.status_mut() = status;
        res.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if self.etags {
            res.headers_mut().insert(header::ETAG, etag_for(version));
        }
        res
    }
}

const PREFERENCE_APPLIED: &str = "preference-applied";

/// Whether a request states `Prefer: return=minimal` (RFC 7240): a write answered without the
/// document, which the writer already has.
fn prefers_minimal(headers: &http::HeaderMap) -> bool {
    headers.get_all(crate::upstream::PREFER).iter().any(|v| {
        v.to_str().is_ok_and(|list| {
            list.split(',').any(|p| {
                p.split(';')
                    .next()
                    .is_some_and(|p| p.trim().eq_ignore_ascii_case(crate::upstream::RETURN_MINIMAL))
            })
        })
    })
}

/// Whether an `If-None-Match` list names `version` (or is `*`).
fn none_match(value: &HeaderValue, version: u64) -> bool {
    let Ok(list) = value.to_str() else { return false };
    list.split(',').map(str::trim).any(|tag| {
        tag == "*"
            || crate::http::version_from_etag(tag) == Some(version) && tag.trim_start_matches("W/").starts_with('"')
    })
}

fn expectation(headers: &http::HeaderMap) -> Result<Expect, &'static str> {
    if let Some(v) = headers.get(header::IF_NONE_MATCH) {
        return if v.as_bytes() == b"*" {
            Ok(Expect::Absent)
        } else {
            Err("only If-None-Match: * is supported")
        };
    }
    match headers.get(header::IF_MATCH) {
        None => Ok(Expect::Any),
        Some(v) if v.as_bytes() == b"*" => Ok(Expect::Exists),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(version_from_etag)
            .map(Expect::Version)
            .ok_or("If-Match must be an entity tag this store issued"),
    }
}
