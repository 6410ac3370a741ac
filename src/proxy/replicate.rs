//! Replication into a database of sessions' documents: CouchDB's `POST /_replicate` and the
//! documents of its `_replicator` database start a replication, which writes the source's
//! documents into the target as given (revisions and all, as `_bulk_docs` with
//! `new_edits: false` does): a session's document there would be replaced past the lock, the
//! merge and the turn check. Such a request is refused at the sidecar; a replication into a
//! database no write route names is passed on.

use http::{Method, Request};
use percent_encoding::utf8_percent_encode;
use serde_json::{Map, Value};

use super::error::{EdgeError, Refusal};
use super::named;
use crate::http::Body;
use crate::routes::{Dialect, Routes};

/// The request, its body read, when it may start a replication: a `POST` or `PUT` whose first
/// name is one of the dialect's replication resources.
pub fn is_replication(routes: &Routes, req: &Request<Body>) -> Option<&'static Dialect> {
    if !matches!(*req.method(), Method::POST | Method::PUT) {
        return None;
    }
    let (_, dialect) = routes.named_in_body()?;
    let first = req.uri().path().trim_start_matches('/').split('/').next()?;
    let first = percent_encoding::percent_decode_str(first).decode_utf8_lossy();
    dialect.replication.contains(&first.as_ref()).then_some(dialect)
}

/// `req` as it came (its body read), or the refusal of a replication whose target is a
/// database whose documents a write route names.
pub async fn checked(routes: &Routes, req: Request<Body>, max: usize) -> Result<Request<Body>, Refusal> {
    let (parts, bytes, body) = named::read_object(req, max).await?;
    // One replication, or a bulk write of several replication documents.
    let targets: Vec<&Value> = match body.get("docs") {
        Some(Value::Array(docs)) => docs.iter().filter_map(|d| d.get("target")).collect(),
        _ => body.get("target").into_iter().collect(),
    };
    if let Some(target) = targets.into_iter().find(|t| into_sessions(routes, t)) {
        return Err(EdgeError::Invalid {
            code: "replication_into_sessions",
            message: format!(
                "a replication writes documents as given, past the merge and the turn check, and its \
                 target {target} holds sessions' documents: start it at the store itself"
            ),
        }
        .into());
    }
    Ok(Request::from_parts(parts, crate::http::full(bytes)))
}

/// Whether a replication's `target` (a database's name, its URL, or `{"url": …}`) is a
/// database whose documents a write route names, whichever server the URL names: a sidecar
/// cannot tell every name its store goes by.
fn into_sessions(routes: &Routes, target: &Value) -> bool {
    let named = match target {
        Value::String(s) => s.as_str(),
        Value::Object(o) => match o.get("url") {
            Some(Value::String(s)) => s.as_str(),
            _ => return false,
        },
        _ => return false,
    };
    let collection = if named.contains("://") {
        match named.parse::<http::Uri>() {
            Ok(uri) => uri.path().trim_end_matches('/').to_owned(),
            // Not a URL the store could reach either.
            Err(_) => return false,
        }
    } else {
        format!("/{}", utf8_percent_encode(named, named::ID))
    };
    let probe = Value::Object(Map::from_iter([(
        "_id".to_owned(),
        Value::String("turnlock-replication-target".to_owned()),
    )]));
    // A path the stores read two ways is counted as a session's database.
    !matches!(
        named::document_route(routes, &collection, None, &http::HeaderMap::new(), &probe, "_id"),
        Ok(None)
    )
}
