//! A store whose `If-Match` cannot be relied on (an ETag of the size alone, a precondition
//! checked apart from the write, as some WebDAV servers do): turnlock's commit order holds
//! without it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{json, Value};
use turnlock::client::JsonClient;

use crate::support::{client, proxy, proxy_args, serve, RedisServer};

/// One document, an ETag of its size, and a precondition checked before a pause and the
/// write: two conditional writes of one version both pass.
async fn weak_store() -> std::net::SocketAddr {
    let doc: Arc<Mutex<Option<Bytes>>> = Arc::new(Mutex::new(None));
    serve(move |req: Request<Incoming>| {
        let doc = doc.clone();
        async move {
            let respond = |status: u16, etag: Option<String>, body: Bytes| {
                let mut b = Response::builder().status(status);
                if let Some(e) = etag {
                    b = b.header("etag", e);
                }
                b.body(Full::new(body)).expect("response")
            };
            let etag_of = |b: &Bytes| format!("\"{}\"", b.len());
            if req.uri().path() == "/" {
                return respond(200, None, Bytes::new());
            }
            match *req.method() {
                Method::GET => match doc.lock().expect("lock").clone() {
                    Some(b) => respond(200, Some(etag_of(&b)), b),
                    None => respond(404, None, Bytes::new()),
                },
                Method::PUT => {
                    let if_match = req.headers().get("if-match").map(|v| v.as_bytes().to_vec());
                    let create = req.headers().contains_key("if-none-match");
                    let body = req
                        .into_body()
                        .collect()
                        .await
                        .map(|c| c.to_bytes())
                        .unwrap_or_default();
                    let current = doc.lock().expect("lock").clone();
                    let passes = match (&current, if_match, create) {
                        (Some(_), _, true) => false,
                        (Some(cur), Some(tag), _) => etag_of(cur).as_bytes() == tag.as_slice(),
                        (None, Some(_), _) => false,
                        _ => true,
                    };
                    if !passes {
                        return respond(412, None, Bytes::new());
                    }
                    // Checked, then written: not atomic.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let etag = etag_of(&body);
                    *doc.lock().expect("lock") = Some(body);
                    respond(204, Some(etag), Bytes::new())
                }
                _ => respond(405, None, Bytes::new()),
            }
        }
    })
    .await
}

const ROUNDS: u64 = 25;

fn ids_of(doc: &Value) -> Vec<String> {
    doc["messages"]
        .as_array()
        .map(|m| m.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// GET-modify-PUT with `If-Match`, straight to the store.
async fn direct_write(c: &JsonClient, id: String) -> bool {
    let Ok(got) = c.send(Method::GET, "/v1/sessions/w", None, &[]).await else {
        return false;
    };
    let etag = got
        .headers
        .get("etag")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut doc = got.json;
    if let Some(list) = doc["messages"].as_array_mut() {
        list.push(json!({"id": id, "role": "user", "content": "x"}));
    }
    c.send(Method::PUT, "/v1/sessions/w", Some(&doc), &[("if-match", etag)])
        .await
        .is_ok_and(|r| r.status.is_success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stand_in_store_loses_conditional_writes_on_its_own() {
    let store = weak_store().await;
    let c = JsonClient::new(format!("http://{store}"));
    let seed = json!({"messages": []});
    c.send(Method::PUT, "/v1/sessions/w", Some(&seed), &[])
        .await
        .expect("seed");
    let mut acked = Vec::new();
    for r in 0..ROUNDS {
        let (a, b) = tokio::join!(direct_write(&c, format!("a{r}")), direct_write(&c, format!("b{r}")));
        acked.extend(
            [(a, format!("a{r}")), (b, format!("b{r}"))]
                .into_iter()
                .filter(|(ok, _)| *ok)
                .map(|(_, id)| id),
        );
    }
    let stored = ids_of(
        &c.send(Method::GET, "/v1/sessions/w", None, &[])
            .await
            .expect("get")
            .json,
    );
    let lost: Vec<_> = acked.iter().filter(|id| !stored.contains(id)).collect();
    assert!(
        !lost.is_empty(),
        "the stand-in's If-Match held: this control proves nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_of_different_turns_lose_nothing_when_the_stores_if_match_is_weak() {
    let store = weak_store().await;
    let redis = RedisServer::start();
    let a = proxy(proxy_args(store, Some(&redis))).await;
    let b = proxy(proxy_args(store, Some(&redis))).await;
    let (ca, cb) = (client(a.addr), client(b.addr));
    let append = |c: JsonClient, turn: u64, id: String| async move {
        let body = json!({"turn": turn, "messages": [{"id": id, "role": "user", "content": "x"}]});
        let r = c.send(Method::POST, "/v1/sessions/w/messages", Some(&body), &[]).await;
        r.is_ok_and(|r| r.status.is_success())
    };
    assert!(append(ca.clone(), 1, "seed".into()).await);
    let mut acked = Vec::new();
    for r in 1..=ROUNDS {
        // Two turns at once on two proxies: two lock keys; only the commit order keeps both.
        let (x, y) = tokio::join!(
            append(ca.clone(), 2 * r, format!("a{r}")),
            append(cb.clone(), 2 * r + 1, format!("b{r}"))
        );
        acked.extend(
            [(x, format!("a{r}")), (y, format!("b{r}"))]
                .into_iter()
                .filter(|(ok, _)| *ok)
                .map(|(_, id)| id),
        );
    }
    let got = ca.send(Method::GET, "/v1/sessions/w", None, &[]).await.expect("get");
    assert_eq!(got.status, StatusCode::OK);
    let stored = ids_of(&got.json);
    let lost: Vec<_> = acked.iter().filter(|id| !stored.contains(id)).collect();
    assert!(
        acked.len() as u64 > ROUNDS,
        "too few writes acknowledged to prove anything: {acked:?}"
    );
    assert!(
        lost.is_empty(),
        "acknowledged writes lost: {lost:?} (stored {stored:?})"
    );
}
