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
            Ok(uri) => without_dot_segments(uri.path()).trim_end_matches('/').to_owned(),
            // A URL turnlock cannot read may still be one the store's client reads (WHATWG
            // URLs drop tabs and newlines): counted as a session's.
            Err(_) => return true,
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

/// `path` with its dot segments resolved, as the store's HTTP client resolves them before
/// sending (RFC 3986 §5.2.4; `%2E` read as `.` and `\` as `/`, as WHATWG URLs of `http` and
/// `https` read them): `/x/../db`, `/x\..\db` and `/db/.` name the database `db`.
fn without_dot_segments(path: &str) -> String {
    let path = path.replace('\\', "/");
    let segments: Vec<String> = path
        .trim_start_matches('/')
        .split('/')
        .map(|s| s.replace("%2E", ".").replace("%2e", "."))
        .collect();
    let last = segments.len().saturating_sub(1);
    let mut out: Vec<&str> = Vec::with_capacity(segments.len());
    for (i, segment) in segments.iter().enumerate() {
        match segment.as_str() {
            "." => {}
            ".." => {
                out.pop();
            }
            name => out.push(name),
        }
        // A path ending in a dot segment names a directory: it ends with `/`.
        if i == last && matches!(segment.as_str(), "." | "..") {
            out.push("");
        }
    }
    format!("/{}", out.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments_are_resolved_as_a_client_resolves_them() {
        for (path, resolved) in [
            ("/sessions", "/sessions"),
            ("/x/../sessions", "/sessions"),
            ("/a/b/../../sessions", "/sessions"),
            ("/sessions/../sessions", "/sessions"),
            ("/x/%2E%2E/sessions", "/sessions"),
            ("/x/.%2e/sessions", "/sessions"),
            ("/sessions/.", "/sessions/"),
            ("/sessions/x/..", "/sessions/"),
            ("/../sessions", "/sessions"),
            ("/./sessions", "/sessions"),
            ("/a%2E/b", "/a./b"),
            ("/x\\..\\sessions", "/sessions"),
        ] {
            assert_eq!(without_dot_segments(path), resolved, "{path}");
        }
    }
}
