//! The forward commits: serialized writes and deletes, each forwarded unchanged under the
//! grant and the resource's commit slot.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::HeaderMap;
use http::{Request, StatusCode};
use tokio::time::Instant;

use super::errors::refused;
use super::queue::{Pending, Queue};
use super::slot::SlotHold;
use super::{DeleteWrite, Forwarded, Shared};
use crate::http::Body;
use crate::http::{full, strip_hop_by_hop};
use crate::lock::{Lease, Settled};
use crate::merge::MergeError;
use crate::proxy::answer::Answer;
use crate::proxy::error::WriteError;
use crate::session::is_stale;
use crate::upstream::{Reserved, UpstreamError, FENCING_TOKEN};

/// Serialize mode: each write is forwarded unchanged, one after another under the grant and
/// under the resource's commit slot, after the stale check against turnlock's own turn mark.
/// The mark is raised (with the lock's release) only by a write the store accepted, or may
/// have; writes of other turns to the same resource, on any proxy, wait for the slot, so they
/// reach the store one at a time.
pub(super) async fn serialize_batch(
    s: &Shared,
    queue: &Queue<Forwarded>,
    lease: &Lease,
    batch: &[Pending<Forwarded>],
    slot: &mut SlotHold,
) -> Vec<Answer> {
    let mut answers = Vec::with_capacity(batch.len());
    // The slot is held from the first write to the lock's release, where the turn mark is
    // raised: only this writer can move the mark meanwhile, and every write of the batch has
    // the same turn, so the mark read with the slot serves the whole batch.
    for p in batch {
        let (answer, settled) = serialize_one(s, lease, queue, p, slot).await;
        match settled {
            Some(settled) => slot.settle(settled),
            // Unknown outcome: the slot expires by itself, after the write can have landed,
            // and the write's turn counts as accepted (it may be stored).
            None => {
                slot.settle(Settled::Accepted(queue.turn));
                slot.abandon();
            }
        }
        answers.push(answer);
    }
    answers
}

/// One serialized write; with what the store did, or `None` when its outcome is unknown.
pub(super) async fn serialize_one(
    s: &Shared,
    lease: &Lease,
    queue: &Queue<Forwarded>,
    p: &Pending<Forwarded>,
    slot: &mut SlotHold,
) -> (Answer, Option<Settled>) {
    let (turn, turn_given, resource) = (queue.turn, queue.turn_given, queue.path.as_str());
    let Forwarded {
        method,
        path_and_query,
        headers,
        body,
        once,
    } = &p.write;
    if let Err(answer) = slot.hold(s, lease).await {
        return (answer, Some(Settled::Unchanged));
    }
    // A write without a turn (on a route whose turn is optional) is not stale-checked.
    if turn_given && is_stale(turn, slot.turn_mark) {
        let stale = MergeError::StaleTurn {
            turn,
            current: slot.turn_mark,
        };
        return (refused(s, stale), Some(Settled::Unchanged));
    }
    let precondition = match once {
        Some(once) => match super::once::precondition(s, resource, body, once).await {
            Ok(p) => Some(p),
            Err(answer) => return (answer, Some(Settled::Unchanged)),
        },
        None => None,
    };
    let conn = match slot.reserve(s, lease, false).await {
        Ok(conn) => conn,
        Err(answer) => return (answer, Some(Settled::Unchanged)),
    };
    // Checked after the read of an object created once: the forward follows at once.
    if !lease.check() {
        return (Answer::from(WriteError::LeaseLost), Some(Settled::Unchanged));
    }
    let mut headers = headers.clone();
    if let Some((name, value)) = precondition {
        headers.remove(header::IF_MATCH);
        headers.remove(header::IF_NONE_MATCH);
        headers.insert(name, value);
    }
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    // The whole body is in hand: nothing to wait for (and a signed `Expect` would not reach
    // every store as it was signed).
    headers.remove(header::EXPECT);
    headers.insert(FENCING_TOKEN, HeaderValue::from(lease.fence()));
    let uri = match s.upstream.uri(path_and_query) {
        Ok(u) => u,
        Err(e) => {
            let answer = Answer::from(WriteError::InvalidPath(e.to_string()));
            return (answer, Some(Settled::Unchanged));
        }
    };
    let mut req = Request::new(full(body.clone()));
    *req.method_mut() = method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    // Signed by turnlock when it signs for this store, as a passed-through request is: the
    // client's signature names the sidecar, not the store.
    let (mut parts, req_body) = req.into_parts();
    if let Err(e) = s.upstream.sign_forwarded(&mut parts) {
        return (Answer::from(WriteError::Upstream(e)), Some(Settled::Unchanged));
    }
    let req = Request::from_parts(parts, req_body);
    match store_answer(s, "forward", conn, req).await {
        Ok(answer) => {
            let settled = if answer.status.is_success() {
                Settled::Accepted(turn)
            } else {
                Settled::Unchanged
            };
            (answer, Some(settled))
        }
        Err(Failed { error, .. }) => {
            let settled = (!error.outcome_unknown()).then_some(Settled::Unchanged);
            (Answer::from(WriteError::Upstream(error)), settled)
        }
    }
}

/// Deletes of one document, each forwarded under the document's commit slot: a write ordered
/// before a delete is deleted with the document; a write ordered after it starts the
/// document's next life (`201`, holding only what was written since). The store's answer is
/// passed through; on `2xx`, or `404` with the document absent when read back, the
/// document's turn mark goes with it.
pub(super) async fn delete_batch(
    s: &Shared,
    queue: &Queue<DeleteWrite>,
    lease: &Lease,
    batch: &[Pending<DeleteWrite>],
    slot: &mut SlotHold,
) -> Vec<Answer> {
    let mut answers = Vec::with_capacity(batch.len());
    for p in batch {
        let (answer, settled) = delete_one(s, lease, &queue.path, p, slot).await;
        match settled {
            Some(settled) => slot.settle(settled),
            // Unknown outcome: the slot expires by itself, after the delete can have landed.
            None => slot.abandon(),
        }
        answers.push(answer);
    }
    answers
}

/// One delete; with what the store did, or `None` when its outcome is unknown.
///
/// A delete whose connection failed before any answer (most often a pooled connection the
/// store had just closed) is sent once more, on a connection opened for it, as HTTP lets an
/// idempotent request be: the agent gets the store's answer rather than a 502. Not a
/// conditional one: had the first landed, the second would be refused its precondition, the
/// opposite of what happened. The first copy's outcome stays unknown all the same (a store
/// can apply a request whose connection it then drops), so the slot is still left to lapse.
pub(super) async fn delete_one(
    s: &Shared,
    lease: &Lease,
    path: &str,
    p: &Pending<DeleteWrite>,
    slot: &mut SlotHold,
) -> (Answer, Option<Settled>) {
    if let Err(answer) = slot.hold(s, lease).await {
        return (answer, Some(Settled::Unchanged));
    }
    let conn = match slot.reserve(s, lease, false).await {
        Ok(conn) => conn,
        Err(answer) => return (answer, Some(Settled::Unchanged)),
    };
    if !lease.check() {
        return (Answer::from(WriteError::LeaseLost), Some(Settled::Unchanged));
    }
    let req = match delete_request(s, lease, path, &p.write) {
        Ok(req) => req,
        Err(answer) => return (answer, Some(Settled::Unchanged)),
    };
    let first = match send_delete(s, lease, conn, req, path, &p.write).await {
        Ok(answered) => return answered,
        // The store's answer had begun (its body failed): it had the delete.
        Err(Failed { error, begun: true }) => {
            let settled = (!error.outcome_unknown()).then_some(Settled::Unchanged);
            return (Answer::from(WriteError::DeleteFailed(error)), settled);
        }
        Err(Failed { error, begun: false }) => error,
    };
    let resend = matches!(first, UpstreamError::Unreachable(_) | UpstreamError::NotSent(_))
        && !is_conditional(&p.write.headers)
        && lease.check();
    let settled = (!first.outcome_unknown()).then_some(Settled::Unchanged);
    if !resend {
        return (Answer::from(WriteError::DeleteFailed(first)), settled);
    }
    let (Ok(conn), Ok(req)) = (
        slot.reserve(s, lease, true).await,
        delete_request(s, lease, path, &p.write),
    ) else {
        return (Answer::from(WriteError::DeleteFailed(first)), settled);
    };
    tracing::info!(error = %first, "session delete failed before any answer; sent once more");
    s.metrics.upstream_retry();
    match send_delete(s, lease, conn, req, path, &p.write).await {
        // The store's answer, when it tells what became of the delete: the first copy was not
        // sent, or the document is gone now (deleted by either copy). Known then, unless the
        // first copy may still land. Another answer (a 503) says nothing of the first copy.
        Ok((answer, again))
            if settled.is_some() || answer.status.is_success() || answer.status == StatusCode::NOT_FOUND =>
        {
            (answer, settled.and(again))
        }
        _ => (Answer::from(WriteError::DeleteFailed(first)), settled),
    }
}

/// Whether a request is conditional on the state of what it names.
fn is_conditional(headers: &HeaderMap) -> bool {
    [
        header::IF_MATCH,
        header::IF_NONE_MATCH,
        header::IF_UNMODIFIED_SINCE,
        header::IF_MODIFIED_SINCE,
    ]
    .iter()
    .any(|h| headers.contains_key(h))
}

/// The store's request for an agent's session delete: its query string and headers, under
/// this grant's fence.
fn delete_request(s: &Shared, lease: &Lease, path: &str, agent: &DeleteWrite) -> Result<Request<Body>, Answer> {
    let query = agent
        .query
        .as_deref()
        .map(|q| kept_query(q, agent.store.dialect.delete_query))
        .filter(|q| !q.is_empty());
    let uri = match query {
        Some(query) => s.upstream.uri(&format!("{path}?{query}")),
        None => s.upstream.uri(path),
    }
    .map_err(|e| Answer::from(WriteError::InvalidPath(e.to_string())))?;
    let mut headers = agent.headers.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(FENCING_TOKEN, HeaderValue::from(lease.fence()));
    let mut req = Request::new(full(Bytes::new()));
    *req.method_mut() = http::Method::DELETE;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    Ok(req)
}

/// The parameters of `query` named in `kept` (names read decoded, as the store reads them),
/// each as the client spelled it; all of them when `kept` is `None`.
fn kept_query(query: &str, kept: Option<&[&str]>) -> String {
    let Some(kept) = kept else {
        return query.to_owned();
    };
    query
        .split('&')
        .filter(|pair| {
            let name = pair.split('=').next().unwrap_or_default();
            let name = percent_encoding::percent_decode_str(&name.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned();
            kept.contains(&name.as_str())
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// Why the store's answer to a request could not be passed on.
struct Failed {
    error: UpstreamError,
    /// The store's answer had begun (its head came, its body failed).
    begun: bool,
}

/// Sends a delete: the store's answer with what it did, or why none came.
///
/// A `404` says the document is gone only when a read says so too: a store may answer it to
/// a delete that named something the document no longer is (CouchDB, to a revision it does
/// not have), the document still there and its turn mark still due. Read under this grant:
/// nothing writes the document meanwhile. A read that fails keeps the mark (an older turn
/// refused, rather than let through).
async fn send_delete(
    s: &Shared,
    lease: &Lease,
    conn: Reserved,
    req: Request<Body>,
    path: &str,
    write: &DeleteWrite,
) -> Result<(Answer, Option<Settled>), Failed> {
    let answer = store_answer(s, "delete", conn, req).await?;
    let settled = if answer.status.is_success() {
        Settled::Deleted
    } else if answer.status == StatusCode::NOT_FOUND && lease.check() {
        match s.upstream.get_document_raw_with(path, &write.store).await {
            Ok(read) if read.body.is_none() => Settled::Deleted,
            Ok(_) => Settled::Unchanged,
            Err(error) => {
                tracing::warn!(%error, path, "a delete answered 404: the document could not be read back; its turn mark stays");
                Settled::Unchanged
            }
        }
    } else {
        Settled::Unchanged
    };
    Ok((answer, Some(settled)))
}

/// Sends a request on a reserved store connection and reads the store's whole answer, to be
/// passed on as it is (less its hop-by-hop headers and length), counted as `kind`.
async fn store_answer(s: &Shared, kind: &'static str, conn: Reserved, req: Request<Body>) -> Result<Answer, Failed> {
    let started = Instant::now();
    let result = match s.upstream.send_reserved(conn, req).await {
        Ok(res) => {
            let status = res.status();
            let mut headers = res.headers().clone();
            strip_hop_by_hop(&mut headers);
            headers.remove(header::CONTENT_LENGTH);
            let body = s.upstream.body(res).await;
            body.map(|body| Answer {
                status,
                headers: headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                body,
                passed_on: true,
            })
            .map_err(|error| Failed { error, begun: true })
        }
        Err(error) => Err(Failed { error, begun: false }),
    };
    s.metrics.upstream(kind, started.elapsed());
    s.metrics
        .upstream_response(kind, result.as_ref().map_or(0, |answer| answer.status.as_u16()));
    result
}

#[cfg(test)]
mod tests {
    use super::kept_query;

    #[test]
    fn a_delete_keeps_the_parameters_its_dialect_names_as_spelled() {
        assert_eq!(kept_query("rev=1-a&new_edits=", Some(&["rev"])), "rev=1-a");
        assert_eq!(kept_query("new_edits=&r%65v=2-b&batch=ok", Some(&["rev"])), "r%65v=2-b");
        assert_eq!(kept_query("rev[0]=1-a&w=1", Some(&["rev"])), "");
        assert_eq!(kept_query("a=1&b", None), "a=1&b");
    }
}
