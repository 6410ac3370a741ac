//! Several documents written in one request: CouchDB's `POST /{db}/_bulk_docs` with
//! `{"docs": [...]}` (nano's `db.bulk`, PouchDB's `bulkDocs`). CouchDB writes each document on
//! its own (one may fail while the others are written) and answers one entry per document, in
//! order. The documents a write route names are taken out and written one by one as their
//! `PUT`s (locked, merged, turn-checked); the others go to the store as a `_bulk_docs` of their
//! own; the answer puts both back in the order of the request.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Map, Value};

use super::error::{EdgeError, Refusal};
use super::named::{self, Named};
use super::request::{valid_idempotency_key, EntryKey, IDEMPOTENCY_KEY, MAX_IDEMPOTENCY_KEY_LEN};
use super::Proxy;
use crate::http::Body;
use crate::routes::{Captures, Dialect, Route};

/// The body field listing the documents, and the flag that stores them as given (revisions
/// and all: replication's writes, which a merge would change), as CouchDB names them.
const DOCS: &str = "docs";
const AS_GIVEN: &str = "new_edits";

/// Whether `req` is a bulk write to a collection whose documents a write route names: the
/// body field naming each document, and the dialect, when so.
pub fn is_bulk(proxy: &Proxy, req: &Request<Body>) -> Option<(&'static str, &'static Dialect)> {
    if req.method() != Method::POST {
        return None;
    }
    let (field, dialect) = proxy.inner.routes.named_in_body()?;
    let endpoint = dialect.bulk_endpoint?;
    (named::last_name(req.uri().path()) == endpoint).then_some((field, dialect))
}

/// A session document's entry as its own write: its place in the request, its id, its
/// route, the route's captures and its `PUT`.
type EntryWrite<'r> = (usize, String, &'r Route, Captures, Request<Body>);

/// One document of the request.
enum Part<'r> {
    /// Written as its `PUT` on its route.
    Session(Named<'r>),
    /// Sent to the store in the remaining `_bulk_docs`.
    Store,
}

impl Proxy {
    /// Serves a bulk write (see the module's documentation).
    pub(super) async fn bulk(
        &self,
        req: Request<Body>,
        (field, dialect): (&'static str, &'static Dialect),
        peer: SocketAddr,
    ) -> Response<Body> {
        let refuse = |e: EdgeError| super::dialect::refusal(dialect, Refusal::from(e));
        // Several documents: a few times the limit of one.
        let limits = self.inner.max_body;
        let max = limits.document.max(limits.body).saturating_mul(8);
        // One without a list of documents is the store's to refuse.
        let (parts, bytes, mut request) = match named::read_object(req, max).await {
            Ok(read) => read,
            Err(refusal) => return super::dialect::refusal(dialect, refusal),
        };
        let as_it_came = |parts, bytes| Request::from_parts(parts, crate::http::full(bytes));
        let Some(Value::Array(docs)) = request.remove(DOCS) else {
            return self.forward(as_it_came(parts, bytes), peer).await;
        };
        let path = parts.uri.path();
        let collection = path.strip_suffix('/').unwrap_or(path);
        let collection = collection.rsplit_once('/').map_or("", |(c, _)| c);
        let mut sessions = 0;
        let mut split = Vec::with_capacity(docs.len());
        for doc in &docs {
            let part = match named::document_route(
                &self.inner.routes,
                collection,
                parts.uri.query(),
                &parts.headers,
                doc,
                field,
            ) {
                Ok(None) => Part::Store,
                Ok(Some(named)) => {
                    sessions += 1;
                    Part::Session(named)
                }
                Err(ambiguous) => return refuse(EdgeError::AmbiguousPath(ambiguous)),
            };
            split.push(part);
        }
        if sessions == 0 {
            return self.forward(as_it_came(parts, bytes), peer).await;
        }
        // A type each session document's write would refuse is the whole request's refusal
        // (CouchDB answers a bulk write 415 as a whole), not one error entry per document.
        if let Err(refused) = super::request::check_content_type(&parts.headers, false) {
            return super::dialect::refusal(dialect, refused);
        }
        // Anything but `true` may be read as `false` (pouchdb-server takes `0`, `null` and `""`
        // so): refused as `false` is.
        if let Some(as_given) = request.get(AS_GIVEN).filter(|v| **v != Value::Bool(true)) {
            return refuse(EdgeError::Invalid {
                code: "bulk_as_given",
                message: format!(
                    "{AS_GIVEN}={as_given} may store documents as given, past the merge, and {sessions} of \
                     these are sessions' documents: write those through their own PUT ({AS_GIVEN} true or absent)"
                ),
            });
        }
        // The store's documents first, as one bulk write: a refusal of the whole (a missing
        // database, no access) is the answer, and no session's document is written.
        let mut entries: Vec<Option<Value>> = vec![None; docs.len()];
        let others: Vec<&Value> = docs
            .iter()
            .zip(&split)
            .filter(|(_, p)| matches!(p, Part::Store))
            .map(|(d, _)| d)
            .collect();
        if !others.is_empty() {
            let mut rest = request.clone();
            rest.insert(DOCS.to_owned(), Value::Array(others.into_iter().cloned().collect()));
            let rest = Bytes::from(serde_json::to_vec(&Value::Object(rest)).unwrap_or_default());
            let rest_len = rest.len();
            let mut rest = as_it_came(parts.clone(), rest);
            named::state_length(rest.headers_mut(), rest_len);
            // Written by turnlock as JSON, and typed so: CouchDB servers read only that.
            rest.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            let res = self.forward(rest, peer).await;
            if !res.status().is_success() {
                return res;
            }
            let Some(Value::Array(answered)) = json_of(res).await else {
                return refuse(EdgeError::Forward(crate::upstream::UpstreamError::InvalidAnswer(
                    "the store's answer to a bulk write is not a list of its documents' answers".into(),
                )));
            };
            let at = split
                .iter()
                .enumerate()
                .filter(|(_, p)| matches!(p, Part::Store))
                .map(|(i, _)| i);
            for (i, entry) in at.zip(answered) {
                entries[i] = Some(entry);
            }
        }
        let key = parts.headers.get(IDEMPOTENCY_KEY).cloned();
        if key.as_ref().is_some_and(|k| !valid_idempotency_key(k)) {
            return refuse(EdgeError::Invalid {
                code: "invalid_idempotency_key",
                message: format!("Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} bytes"),
            });
        }
        let writes: Vec<EntryWrite<'_>> = docs
            .into_iter()
            .zip(split)
            .enumerate()
            .filter_map(|(i, (doc, part))| match part {
                Part::Session(Named {
                    id,
                    route,
                    captures,
                    uri,
                }) => {
                    let body = serde_json::to_vec(&doc).unwrap_or_default();
                    let len = body.len();
                    let mut one = http::Request::new(crate::http::full(body));
                    *one.method_mut() = Method::PUT;
                    *one.uri_mut() = uri;
                    *one.headers_mut() = parts.headers.clone();
                    // A retried bulk write replays each document's own first answer.
                    one.headers_mut().remove(IDEMPOTENCY_KEY);
                    if let Some(key) = &key {
                        one.extensions_mut().insert(EntryKey::of(key.as_bytes(), i));
                    }
                    named::state_length(one.headers_mut(), len);
                    Some((i, id, route, captures, one))
                }
                Part::Store => None,
            })
            .collect();
        // Each document's entries one after the other, in the request's order (CouchDB
        // applies a list naming one document twice in its order: a later turn does not go
        // first and refuse the earlier one as stale); different documents at once.
        let mut by_document: Vec<Vec<EntryWrite<'_>>> = Vec::new();
        for write in writes {
            match by_document
                .iter_mut()
                .find(|group| group[0].4.uri().path() == write.4.uri().path())
            {
                Some(group) => group.push(write),
                None => by_document.push(vec![write]),
            }
        }
        let documents = by_document.into_iter().map(|group| async move {
            let mut answered = Vec::with_capacity(group.len());
            for (i, id, route, captures, one) in group {
                let res = self.write(route, captures, one, peer).await;
                answered.push((i, entry_of(&id, res).await));
            }
            answered
        });
        for (i, entry) in futures_util::future::join_all(documents).await.into_iter().flatten() {
            entries[i] = Some(entry);
        }
        let body = Value::Array(entries.into_iter().map(|e| e.unwrap_or(Value::Null)).collect());
        let mut res = Response::new(crate::http::full(serde_json::to_vec(&body).unwrap_or_default()));
        *res.status_mut() = StatusCode::CREATED;
        res.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        res
    }
}

/// An answer's body as JSON, when it is.
async fn json_of(res: Response<Body>) -> Option<Value> {
    let bytes = res.into_body().collect().await.ok()?.to_bytes();
    serde_json::from_slice(&bytes).ok()
}

/// A document's entry in a bulk answer, from the answer to its own `PUT`: CouchDB's
/// `{"ok":true,"id":…,"rev":…}`, or `{"id":…,"error":…,"reason":…}`.
async fn entry_of(id: &str, res: Response<Body>) -> Value {
    let status = res.status();
    match json_of(res).await {
        Some(Value::Object(answer)) if status.is_success() => Value::Object(answer),
        Some(Value::Object(mut answer)) => {
            let mut entry = Map::new();
            entry.insert("id".into(), Value::String(id.to_owned()));
            for key in ["error", "reason", "turnlock_error"] {
                if let Some(v) = answer.remove(key) {
                    entry.insert(key.into(), v);
                }
            }
            Value::Object(entry)
        }
        _ => json!({"id": id, "error": "unknown_error", "reason": format!("answered {status}")}),
    }
}
