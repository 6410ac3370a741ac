//! turnlock's own requests for the session document: the read and the conditional write-back,
//! with the client's kept headers or turnlock's signature.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, StatusCode};
use tokio::time::Instant;

use super::{StoreParts, Upstream, UpstreamError, FENCING_TOKEN, PREFER, RETURN_MINIMAL};
use crate::http::full;
use crate::merge::Document;

/// The precondition of a write-back.
#[derive(Clone, Debug)]
pub enum Precondition {
    /// The store's entity tag as read.
    IfMatch(HeaderValue),
    /// The document must not exist yet.
    Absent,
    /// The store gives no entity tags: ordering is turnlock's own version fence.
    None,
}

/// A document the store sent, parsed: a JSON object whose `messages`, when present, is an array.
pub fn parse_document(bytes: &[u8]) -> Result<crate::merge::Document, UpstreamError> {
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(serde_json::Value::Object(doc)) => {
            if doc.get("messages").is_some_and(|m| !m.is_array()) {
                Err(UpstreamError::InvalidDocument("`messages` is not an array".into()))
            } else {
                Ok(doc)
            }
        }
        Ok(_) => Err(UpstreamError::InvalidDocument("not a JSON object".into())),
        Err(e) => Err(UpstreamError::InvalidDocument(e.to_string())),
    }
}

/// A document as the store sent it.
#[derive(Debug)]
pub struct FetchedRaw {
    pub body: Option<Bytes>,
    pub etag: Option<HeaderValue>,
}

/// A document as read from the store.
#[derive(Debug)]
pub struct Fetched {
    pub doc: Option<Document>,
    pub etag: Option<HeaderValue>,
}

impl Upstream {
    /// Reads the document at `path`, or `None` on 404.
    pub async fn get_document(&self, path: &str) -> Result<Fetched, UpstreamError> {
        self.get_document_with(path, &StoreParts::default()).await
    }

    /// [`Upstream::get_document`] with the client's credentials (its `Authorization`, when
    /// the store's dialect keeps it), or signed by turnlock when configured to.
    pub async fn get_document_with(&self, path: &str, store: &StoreParts) -> Result<Fetched, UpstreamError> {
        let raw = self.get_document_raw_with(path, store).await?;
        let doc = raw.body.as_deref().map(parse_document).transpose()?;
        Ok(Fetched { doc, etag: raw.etag })
    }

    /// Reads a document as the store sent it (`body` `None` when absent), unparsed.
    pub async fn get_document_raw(&self, path: &str) -> Result<FetchedRaw, UpstreamError> {
        self.get_document_raw_with(path, &StoreParts::default()).await
    }

    /// [`Upstream::get_document_raw`] with the client's credentials, or signed by turnlock
    /// when configured to (as [`Upstream::get_document_with`]).
    pub async fn get_document_raw_with(&self, path: &str, store: &StoreParts) -> Result<FetchedRaw, UpstreamError> {
        let started = Instant::now();
        let res = self.send_safe(self.document_read(path, store)?).await;
        self.read_answered(res, started).await
    }

    /// Like [`Upstream::get_document_raw_with`], on the connection `conn` holds, which stays
    /// there for the write-back (see [`Upstream::send_keeping`]). A read that failed before
    /// any answer (a connection the store had closed) is sent once more on a new connection,
    /// which is then the one kept.
    pub async fn get_document_raw_on(
        &self,
        conn: &mut super::Reserved,
        path: &str,
        store: &StoreParts,
    ) -> Result<FetchedRaw, UpstreamError> {
        let started = Instant::now();
        let res = match self.send_keeping(conn, self.document_read(path, store)?).await {
            Err(UpstreamError::Unreachable(_) | UpstreamError::NotSent(_)) if started.elapsed() < self.timeout() => {
                self.metrics.upstream_retry();
                *conn = self.reserve_fresh().await?;
                self.send_keeping(conn, self.document_read(path, store)?).await
            }
            other => other,
        };
        self.read_answered(res, started).await
    }

    /// turnlock's read of a document, with the client's credentials (its `Authorization`,
    /// when the store's dialect keeps it) or signed by turnlock.
    fn document_read(&self, path: &str, store: &StoreParts) -> Result<Request<crate::http::Body>, UpstreamError> {
        let mut req = Request::builder()
            .method(Method::GET)
            .uri(self.uri(path).map_err(|e| UpstreamError::NotSent(e.to_string()))?)
            .header(header::ACCEPT, "application/json")
            .body(crate::http::empty())
            .map_err(|e| UpstreamError::NotSent(e.to_string()))?;
        if let Some(auth) = store.headers.get(header::AUTHORIZATION) {
            req.headers_mut().insert(header::AUTHORIZATION, auth.clone());
        }
        self.sign(&mut req, b"")?;
        Ok(req)
    }

    /// The document in the store's answer to a read: `None` on 404.
    async fn read_answered(
        &self,
        res: Result<http::Response<hyper::body::Incoming>, UpstreamError>,
        started: Instant,
    ) -> Result<FetchedRaw, UpstreamError> {
        self.answered("get", &res);
        let result = match res {
            Err(e) => Err(e),
            Ok(res) if res.status() == StatusCode::NOT_FOUND => {
                // Drain so the connection returns to the pool.
                let _ = self.body(res).await;
                Ok(FetchedRaw { body: None, etag: None })
            }
            Ok(res) if res.status().is_success() => {
                let etag = res.headers().get(header::ETAG).cloned();
                let bytes = self.body(res).await?;
                Ok(FetchedRaw {
                    body: Some(bytes),
                    etag,
                })
            }
            Ok(res) => {
                let status = res.status();
                let body = self.body(res).await.unwrap_or_default();
                Err(UpstreamError::Status { status, body })
            }
        };
        self.metrics.upstream("get", started.elapsed());
        result
    }

    /// Writes the document back under its precondition; returns the store's new entity tag.
    pub async fn put_document(
        &self,
        path: &str,
        doc: Bytes,
        precondition: &Precondition,
        fence: u64,
    ) -> Result<Option<HeaderValue>, UpstreamError> {
        let conn = self.reserve().await?;
        self.put_document_with(conn, path, doc, precondition, fence, &StoreParts::default())
            .await
    }

    /// [`Upstream::put_document`] in a store's dialect: with the client's headers the
    /// dialect keeps (metadata, encryption, content type, credentials), and the dialect's
    /// conflict statuses read as "the document moved". Sent on `conn`, reserved for it.
    pub async fn put_document_with(
        &self,
        conn: super::Reserved,
        path: &str,
        doc: Bytes,
        precondition: &Precondition,
        fence: u64,
        store: &StoreParts,
    ) -> Result<Option<HeaderValue>, UpstreamError> {
        let started = Instant::now();
        let mut req = Request::builder()
            .method(Method::PUT)
            .uri(self.uri(path).map_err(|e| UpstreamError::NotSent(e.to_string()))?);
        if let Some(headers) = req.headers_mut() {
            headers.extend(store.headers.clone());
            headers
                .entry(header::CONTENT_TYPE)
                .or_insert(HeaderValue::from_static("application/json"));
        }
        req = req.header(FENCING_TOKEN, fence);
        // The answer's body is not read in turnlock's own dialect: a store that honours the
        // preference (RFC 7240, as the reference store does) does not send the whole document
        // back. Not on a signed write, nor where the store's answer is the client's.
        if self.signer.is_none() && store.dialect.answers_natively() {
            req = req.header(PREFER, RETURN_MINIMAL);
        }
        req = match precondition {
            Precondition::IfMatch(tag) => req.header(header::IF_MATCH, tag.clone()),
            Precondition::Absent => req.header(header::IF_NONE_MATCH, "*"),
            Precondition::None => req,
        };
        let mut req = req
            .body(full(doc.clone()))
            .map_err(|e| UpstreamError::NotSent(e.to_string()))?;
        self.sign(&mut req, &doc)?;
        let res = self.send_reserved(conn, req).await;
        self.answered("put", &res);
        let result = match res {
            Err(e) => Err(e),
            Ok(res) if res.status().is_success() => {
                let etag = res.headers().get(header::ETAG).cloned();
                let _ = self.body(res).await;
                Ok(etag)
            }
            Ok(res) if store.dialect.is_conflict(res.status().as_u16()) => {
                let status = res.status();
                let body = self.body(res).await.unwrap_or_default();
                if status == StatusCode::CONFLICT && is_fenced_out(&body) {
                    Err(UpstreamError::FencedOut)
                } else {
                    Err(UpstreamError::PreconditionFailed)
                }
            }
            Ok(res) => {
                let status = res.status();
                let body = self.body(res).await.unwrap_or_default();
                if status == StatusCode::CONFLICT && is_fenced_out(&body) {
                    Err(UpstreamError::FencedOut)
                } else {
                    Err(UpstreamError::Status { status, body })
                }
            }
        };
        self.metrics.upstream("put", started.elapsed());
        result
    }
}

/// Whether a store's 409 says the write's fencing token was older than one already stored
/// (the reference store's `--enforce-fencing` answer).
fn is_fenced_out(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| v["error"] == "stale_fencing_token")
}
