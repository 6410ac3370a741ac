//! How the proxy reads a plain HTTP store's answers to its own read and write-back: a 409 on
//! the write-back is re-read and re-merged (as a 412 is), and a failed read says that nothing
//! was written.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use turnlock::client::JsonClient;

use crate::support::*;

/// A store in front of the reference store that answers the first `conflicts` write-backs
/// `409 Conflict` without applying them, and holds reads back by `read_delay`.
async fn store_answering(target: std::net::SocketAddr, conflicts: usize, read_delay: Duration) -> std::net::SocketAddr {
    let direct = JsonClient::new(format!("http://{target}"));
    let left = Arc::new(AtomicUsize::new(conflicts));
    serve(move |req: Request<Incoming>| {
        let (direct, left) = (direct.clone(), left.clone());
        async move {
            let forwarded = Forwarded::read(req).await;
            if forwarded.method == Method::PUT
                && left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            {
                return Response::builder()
                    .status(409)
                    .body(Full::new(Bytes::from_static(b"{\"error\":\"conflict\"}")))
                    .expect("response");
            }
            if forwarded.method == Method::GET && forwarded.path != "/" {
                tokio::time::sleep(read_delay).await;
            }
            forwarded.send(direct).await
        }
    })
    .await
}

#[tokio::test]
async fn a_store_409_on_the_write_back_is_re_read_and_re_merged_not_a_502() {
    let redis = RedisServer::start();
    let store = store().await;
    let front = store_answering(store.addr, 2, Duration::ZERO).await;
    let proxy = proxy(proxy_args(front, Some(&redis))).await;
    let c = client(proxy.addr);
    let r = append(&c, "conflicted", 1, "a").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let r = append(&c, "conflicted", 1, "b").await;
    assert!(r.status.is_success(), "{} {}", r.status, r.json);
    assert_eq!(
        message_ids(&get_doc(&client(store.addr), "conflicted").await.json),
        ["a", "b"]
    );
}

#[tokio::test]
async fn a_failed_read_of_the_document_says_nothing_was_written() {
    let redis = RedisServer::start();
    let store = store().await;
    let slow_reads = store_answering(store.addr, 0, Duration::from_millis(1500)).await;
    let mut args = proxy_args(slow_reads, Some(&redis));
    args.upstream_timeout_ms = 300;
    let proxy = proxy(args).await;
    let r = append(&client(proxy.addr), "unread", 1, "a").await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", r.json);
    let message = r.json["message"].as_str().unwrap_or_default();
    assert!(message.contains("nothing was written"), "{message}");
    assert!(!message.contains("may have been applied"), "{message}");
    // Nothing was, and the document's next write is not held back by a slot left to lapse.
    assert_eq!(
        get_doc(&client(store.addr), "unread").await.status,
        StatusCode::NOT_FOUND
    );
}
