//! The write-back's size on the wire: the sidecar states `Prefer: return=minimal` (RFC 7240)
//! on the document it writes back, and the reference store then answers without sending the
//! whole document again.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::json;

use crate::support::{append, client, get_doc, proxy, proxy_args, serve, store};

#[tokio::test]
async fn store_answers_a_put_preferring_minimal_without_the_document() {
    let store = store().await;
    let c = client(store.addr);
    let doc = json!({"session": "s-min", "turn": 1, "messages": [{"id": "m-1", "content": "x"}]});

    let minimal = c
        .send(
            Method::PUT,
            "/v1/sessions/s-min",
            Some(&doc),
            &[("prefer", "return=minimal".to_owned())],
        )
        .await
        .expect("put");
    assert_eq!(minimal.status, StatusCode::CREATED);
    assert!(minimal.body.is_empty(), "body sent back: {:?}", minimal.body);
    assert_eq!(minimal.headers.get("etag").map(|v| v.as_bytes()), Some(&b"\"1\""[..]));
    assert_eq!(
        minimal.headers.get("preference-applied").map(|v| v.as_bytes()),
        Some(&b"return=minimal"[..])
    );

    // Without the preference the document comes back, at its version.
    let full = c
        .send(Method::PUT, "/v1/sessions/s-min", Some(&doc), &[])
        .await
        .expect("put");
    assert_eq!(full.status, StatusCode::OK);
    assert_eq!(full.json["version"], json!(2));
    assert_eq!(full.json["messages"][0]["id"], json!("m-1"));

    // What was stored under the preference is the whole document.
    let read = get_doc(&c, "s-min").await;
    assert_eq!(read.json["messages"][0]["content"], json!("x"));
    assert_eq!(read.json["version"], json!(2));
}

#[tokio::test]
async fn the_write_back_prefers_a_minimal_answer_and_needs_no_body() {
    // A stand-in store that records the preference of each PUT and answers it with an empty
    // body and an entity tag, as a store honouring `return=minimal` does.
    let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let addr = {
        let seen = seen.clone();
        serve(move |req: Request<Incoming>| {
            let seen = seen.clone();
            async move {
                let mut res = Response::new(Full::new(Bytes::new()));
                if req.method() == Method::PUT {
                    let prefer = req
                        .headers()
                        .get("prefer")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    if let Ok(mut seen) = seen.lock() {
                        seen.push(prefer);
                    }
                    *res.status_mut() = StatusCode::CREATED;
                    res.headers_mut()
                        .insert("etag", http::HeaderValue::from_static("\"1\""));
                } else if req.uri().path() == "/" {
                    *res.status_mut() = StatusCode::OK;
                } else {
                    *res.status_mut() = StatusCode::NOT_FOUND;
                }
                res
            }
        })
        .await
    };
    let proxy = proxy(proxy_args(addr, None)).await;
    let reply = append(&client(proxy.addr), "s-pref", 1, "m-1").await;
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.json);
    assert_eq!(reply.json["version"], json!(1));
    let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
    assert_eq!(seen, vec![Some("return=minimal".to_owned())]);
}
