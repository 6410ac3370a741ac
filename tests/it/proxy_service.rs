//! The proxy as a `tower::Service` driven through `oneshot`, with requests built in memory (no
//! socket to the proxy): routing and the error map's answers, against a real store and Redis
//! on loopback. And the layers around it: a panicking handler answers 500 over a real
//! connection, which then serves the next request.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::support::*;

type Stack = turnlock::proxy::Stack<Full<Bytes>>;

fn request(method: Method, path: &str, headers: &[(&str, &str)], body: Option<Value>) -> Request<Full<Bytes>> {
    let mut builder = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let bytes = match body {
        Some(v) => {
            builder = builder.header("content-type", "application/json");
            serde_json::to_vec(&v).expect("json")
        }
        None => Vec::new(),
    };
    builder.body(Full::new(Bytes::from(bytes))).expect("request")
}

async fn call(service: &Stack, req: Request<Full<Bytes>>) -> (StatusCode, Value) {
    let res = service.clone().oneshot(req).await.expect("infallible");
    let status = res.status();
    let bytes = tokio::time::timeout(Duration::from_secs(10), res.into_body().collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn append_body(turn: u64, id: &str) -> Value {
    json!({"turn": turn, "messages": [{"id": id, "role": "user", "content": id}]})
}

#[tokio::test]
async fn a_write_goes_through_the_pipeline_and_a_read_is_forwarded_in_memory() {
    let store = store().await;
    let redis = RedisServer::start();
    let service: Stack = turnlock::sidecar::service(&proxy_args(store.addr, Some(&redis))).expect("service");

    let (status, body) = call(
        &service,
        request(
            Method::POST,
            "/v1/sessions/s1/messages",
            &[],
            Some(append_body(3, "m1")),
        ),
    )
    .await;
    assert!(status.is_success(), "{status} {body}");
    // The write took the session lock: its turn is now the session's.
    let (status, body) = call(
        &service,
        request(
            Method::POST,
            "/v1/sessions/s1/messages",
            &[],
            Some(append_body(2, "m0")),
        ),
    )
    .await;
    assert_eq!(
        (status.as_u16(), body["error"].as_str()),
        (409, Some("stale_turn")),
        "{body}"
    );
    assert_eq!(body["current_turn"], 3, "{body}");

    // Not a write: forwarded to the store, which answers with the document written above.
    let (status, body) = call(&service, request(Method::GET, "/v1/sessions/s1", &[], None)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(message_ids(&body), vec!["m1".to_string()], "{body}");
}

#[tokio::test]
async fn the_error_map_answers_refusals_in_memory() {
    let store = store().await;
    let redis = RedisServer::start();
    let service: Stack = turnlock::sidecar::service(&proxy_args(store.addr, Some(&redis))).expect("service");

    // No turn: refused before any lock.
    let (status, body) = call(
        &service,
        request(
            Method::POST,
            "/v1/sessions/s2/messages",
            &[],
            Some(json!({"messages": []})),
        ),
    )
    .await;
    assert_eq!(
        (status.as_u16(), body["error"].as_str()),
        (400, Some("missing_turn")),
        "{body}"
    );
    // Not JSON.
    let req = Request::builder()
        .method(Method::POST)
        .uri("/v1/sessions/s2/messages")
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from_static(b"hello")))
        .expect("request");
    let (status, body) = call(&service, req).await;
    assert!(status.is_client_error(), "{status} {body}");
    assert!(body["error"].is_string(), "a JSON error: {body}");
    // A session id that is not one.
    let (status, body) = call(
        &service,
        request(
            Method::POST,
            "/v1/sessions/%00/messages",
            &[],
            Some(append_body(1, "m")),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["error"].is_string(), "a JSON error: {body}");
}

#[tokio::test]
async fn the_store_down_is_answered_by_the_error_map_in_memory() {
    let redis = RedisServer::start();
    // Nothing listens on this port: the store refuses connections.
    let port = free_port();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let service: Stack = turnlock::sidecar::service(&proxy_args(addr, Some(&redis))).expect("service");
    let (status, body) = call(&service, request(Method::GET, "/v1/sessions/s3", &[], None)).await;
    assert!(status.is_server_error(), "{status} {body}");
    assert!(body["error"].is_string(), "a JSON error: {body}");
}

#[tokio::test]
async fn a_panicking_handler_answers_500_and_the_connection_serves_the_next_request() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let handler = tower::service_fn(|req: Request<turnlock::server::RequestBody>| async move {
        if req.uri().path() == "/panic" {
            panic!("handler bug");
        }
        Ok::<_, Infallible>(Response::new(turnlock::http::full("fine")))
    });
    let metrics = turnlock::metrics::Metrics::new();
    let make = move |_| turnlock::proxy::stack(metrics.clone(), handler);
    let server = tokio::spawn(turnlock::server::serve_with(
        listener,
        make,
        false,
        None,
        shutdown.clone(),
        Duration::from_secs(1),
    ));

    // One connection for both requests.
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let get = |path: &str| {
        Request::get(path)
            .header("host", "localhost")
            .body(http_body_util::Empty::<Bytes>::new())
            .expect("request")
    };
    let res = sender
        .send_request(get("/panic"))
        .await
        .expect("an answer to the panic");
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = res.into_body().collect().await.expect("body").to_bytes();
    let body: Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(body["error"], "internal", "{body}");

    sender.ready().await.expect("the connection is still open");
    let res = sender.send_request(get("/ok")).await.expect("the next answer");
    assert_eq!(res.status(), StatusCode::OK);
    let body = res.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&body[..], b"fine");

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("server stops")
        .expect("server task");
}

#[tokio::test]
async fn an_ambiguous_path_is_refused_in_memory_never_forwarded() {
    let store = store().await;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("routes.toml");
    std::fs::write(
        &path,
        "[[route]]\nmethod = \"POST\"\npath = \"/api/threads/{session}/events/\"\nturn = { header = \"X-Turn\" }\nmode = \"serialize\"\n",
    )
    .expect("write routes");
    let mut args = proxy_args(store.addr, Some(&redis));
    args.routes = Some(path.to_string_lossy().into_owned());
    let service: Stack = turnlock::sidecar::service(&args).expect("service");
    let (status, body) = call(
        &service,
        request(
            Method::POST,
            "/api/threads/t2%2F..%2Ft1/events",
            &[("x-turn", "1")],
            Some(json!({})),
        ),
    )
    .await;
    assert_eq!(
        (status.as_u16(), body["error"].as_str()),
        (400, Some("ambiguous_path")),
        "{body}"
    );
}
