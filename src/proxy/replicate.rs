//! Replication through the sidecar: CouchDB's `POST /_replicate` and the documents of its
//! `_replicator` database start a replication, which writes the source's documents into the
//! target as given (revisions and all, as `_bulk_docs` with `new_edits: false` does): a
//! session's document there would be replaced past the lock, the merge and the turn check.
//! Where the target is depends on how the store's replicator reads a URL (pouchdb's own URL
//! reading, not WHATWG's: a line separator ends it, a `/` may sit in its user information),
//! which a sidecar cannot follow spelling by spelling: on a store whose routes name sessions'
//! documents, every replication asked of the sidecar is refused. Replications are started at
//! the store itself.

use http::{Method, Request};

use super::error::{EdgeError, Refusal};
use crate::http::Body;
use crate::routes::{Dialect, Routes};

/// The dialect, when `req` may start a replication: a `POST` or `PUT` whose first name (after
/// a node's prefix, `/_node/{node}/`, which pouchdb-server drops) is one of the dialect's
/// replication resources.
pub fn is_replication(routes: &Routes, req: &Request<Body>) -> Option<&'static Dialect> {
    if !matches!(*req.method(), Method::POST | Method::PUT) {
        return None;
    }
    let (_, dialect) = routes.named_in_body()?;
    let decoded = |name: &str| {
        percent_encoding::percent_decode_str(name)
            .decode_utf8_lossy()
            .into_owned()
    };
    let mut names = req.uri().path().trim_start_matches('/').split('/').map(decoded);
    let mut first = names.next()?;
    if first == "_node" {
        first = names.nth(1)?;
    }
    dialect.replication.contains(&first.as_str()).then_some(dialect)
}

/// The dialect, when `req` writes under a node's own path (`/_node/…`, CouchDB's node-level
/// resources and databases): pouchdb-server strips its node's prefix with a pattern a `?` or
/// a `/` also matches (`/_node/node1@127?0.0.1/db/d` is its `/db/d`), so where such a write
/// lands cannot be told from the path: refused.
pub fn is_node_write(routes: &Routes, req: &Request<Body>) -> Option<&'static Dialect> {
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    let (_, dialect) = routes.named_in_body()?;
    let first = req.uri().path().trim_start_matches('/').split('/').next()?;
    (percent_encoding::percent_decode_str(first).decode_utf8_lossy() == "_node").then_some(dialect)
}

/// The refusal of a write under a node's own path.
pub fn node_refusal() -> Refusal {
    EdgeError::Invalid {
        code: "node_path_refused",
        message: "a write under /_node/ may land on a session's document past the lock: send it to the \
                  store itself"
            .into(),
    }
    .into()
}

/// The refusal of a replication asked of the sidecar.
pub fn refusal() -> Refusal {
    EdgeError::Invalid {
        code: "replication_refused",
        message: "a replication writes documents as given, past the merge and the turn check, and this \
                  store holds sessions' documents: start replications at the store itself"
            .into(),
    }
    .into()
}

/// Server-level resources (a first name starting with `_`) a client may write through the
/// sidecar: logging in and out, and system databases that hold no session's document. Every
/// other server-level write (`/_config`, whose virtual hosts rewrite the paths of the
/// sidecar's own write-backs; `/_restart`, `/_reshard`, …) is an operator's, at the store.
const SERVER_WRITES: &[&str] = &["_session", "_users", "_global_changes", "_dbs_info"];

/// Handlers that write a document of the store's choosing from a request's path: a design
/// document's update function writes whatever it returns, a rewrite sends the request on to
/// a path of the design document's choosing.
const DESIGN_WRITES: &[&str] = &["_update", "_rewrite"];

const REWRITE: &str = "a design document's update function or rewrite writes documents of its own choosing past \
                       the lock";

/// Why `req` is refused, when it would write a session's document past the lock by other
/// means than its path: a `COPY` (its `Destination` header names the document written), a
/// design document's update function or rewrite, `_purge` (drops revisions as given), the
/// deletion of a whole database (its sessions' documents deleted out of order with their
/// writes), or a server-level write outside [`SERVER_WRITES`]. Reads pass.
pub fn unlocked_write(routes: &Routes, req: &Request<Body>) -> Option<(&'static Dialect, &'static str)> {
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    let (_, dialect) = routes.named_in_body()?;
    if req.method().as_str() == "COPY" {
        return Some((
            dialect,
            "a COPY writes the document its Destination names past the lock",
        ));
    }
    // pouchdb-server looks for a design document's rewrite anywhere in the request's target,
    // its query included (`/x/db/_design/r/_rewrite/a`, `/db/_find?q=/db/_design/r/_rewrite/a`),
    // ahead of every other route: wherever it is, the request is a rewrite's.
    let target = req.uri().path_and_query().map_or("", |p| p.as_str());
    let target = percent_encoding::percent_decode_str(target).decode_utf8_lossy();
    if target.contains("/_design/") && target.contains("/_rewrite") {
        return Some((dialect, REWRITE));
    }
    // Decoded before it is split: however its names are spelled, each is found.
    let path = percent_encoding::percent_decode_str(req.uri().path()).decode_utf8_lossy();
    // Dot segments resolved, as a store that resolves them reads the path.
    let mut names: Vec<&str> = Vec::new();
    for name in path.split('/') {
        match name {
            "" | "." => {}
            ".." => {
                names.pop();
            }
            name => names.push(name),
        }
    }
    let first = *names.first()?;
    // `__name__` is how pouchdb-server stores a database `name` (a route's path, read as the
    // store reads it: `ambiguous_path` where it is a session's), not a server resource.
    if first.starts_with('_') && !first.starts_with("__") {
        return (!SERVER_WRITES.contains(&first)).then_some((
            dialect,
            "a server-level write (its configuration, virtual hosts, …) can change where the store \
             lands sessions' writes",
        ));
    }
    match names.as_slice() {
        [_] if *req.method() == Method::DELETE => Some((
            dialect,
            "deleting a database deletes its sessions' documents out of order with their writes",
        )),
        [_, "_purge", ..] => Some((dialect, "a purge drops sessions' revisions past the lock")),
        [_, "_design", _, handler, ..] if DESIGN_WRITES.contains(handler) => Some((dialect, REWRITE)),
        _ => None,
    }
}

/// The refusal of a write [`unlocked_write`] names.
pub fn unlocked_refusal(why: &str) -> Refusal {
    EdgeError::Invalid {
        code: "unlocked_write_refused",
        message: format!("{why}: send it to the store itself"),
    }
    .into()
}
