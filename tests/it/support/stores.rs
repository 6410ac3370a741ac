//! Stand-in upstreams on loopback: a bare HTTP/1 server around a handler, and a store in front
//! of the reference store that holds PUTs back.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::Value;
use tokio::net::TcpListener;
use turnlock::client::JsonClient;

/// An HTTP/1 server on a free loopback port that answers every request with `handle`; it runs
/// as long as the test's runtime.
pub async fn serve<F, Fut>(handle: F) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let handle = handle.clone();
            let svc = hyper::service::service_fn(move |req| {
                let answer = handle(req);
                async move { Ok::<_, Infallible>(answer.await) }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// How a [`front_store`] holds PUTs back.
#[derive(Clone, Copy, Debug)]
pub enum PutDelay {
    /// Every PUT reaches the store only after this delay: a slow store.
    Every(Duration),
    /// The first PUT is applied at once but answered only after this delay: the write lands
    /// even when the proxy has stopped waiting for it.
    FirstAnswer(Duration),
    /// The same for the first `n` PUTs (a write-back and the proxy's attempt to settle it).
    FirstAnswers(usize, Duration),
    /// Every request, reads included, reaches the store only after this delay.
    All(Duration),
}

/// A store in front of the reference store at `target` that forwards every request (with its
/// preconditions and fencing token) and holds PUTs back as `delay` says.
pub async fn front_store(target: SocketAddr, delay: PutDelay) -> SocketAddr {
    let direct = JsonClient::new(format!("http://{target}"));
    let late_answers = Arc::new(AtomicUsize::new(match delay {
        PutDelay::FirstAnswer(_) => 1,
        PutDelay::FirstAnswers(n, _) => n,
        _ => 0,
    }));
    serve(move |req: Request<Incoming>| {
        let (direct, late_answers) = (direct.clone(), late_answers.clone());
        async move {
            let forwarded = Forwarded::read(req).await;
            let is_put = forwarded.method == Method::PUT;
            match (is_put, delay) {
                (true, PutDelay::Every(d)) | (_, PutDelay::All(d)) => tokio::time::sleep(d).await,
                _ => {}
            }
            // Applied on a task of its own: whether the client still waits or not.
            let applied = tokio::spawn(forwarded.send(direct)).await;
            if let (true, PutDelay::FirstAnswer(d) | PutDelay::FirstAnswers(_, d)) = (is_put, delay) {
                let late = late_answers.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
                if late.is_ok() {
                    tokio::time::sleep(d).await;
                }
            }
            applied.unwrap_or_else(|_| bad_gateway())
        }
    })
    .await
}

/// A request to a stand-in store, read whole, to be forwarded to the reference store with its
/// preconditions and fencing token.
pub struct Forwarded {
    pub method: Method,
    pub path: String,
    headers: Vec<(String, String)>,
    body: Bytes,
}

impl Forwarded {
    pub async fn read(req: Request<Incoming>) -> Self {
        let (method, path) = (req.method().clone(), req.uri().path().to_owned());
        let headers = ["if-match", "if-none-match", "x-fencing-token"]
            .iter()
            .filter_map(|h| Some((h.to_string(), req.headers().get(*h)?.to_str().ok()?.to_owned())))
            .collect();
        let body = req
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        Self {
            method,
            path,
            headers,
            body,
        }
    }

    /// Sends it through `direct`: the reference store's status, ETag and body, or 502.
    pub async fn send(self, direct: JsonClient) -> Response<Full<Bytes>> {
        let json: Option<Value> = serde_json::from_slice(&self.body).ok();
        let headers: Vec<(&str, String)> = self.headers.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        match direct.send(self.method, &self.path, json.as_ref(), &headers).await {
            Ok(r) => {
                let mut b = Response::builder().status(r.status);
                if let Some(e) = r.headers.get("etag") {
                    b = b.header("etag", e);
                }
                b.body(Full::new(r.body)).expect("response")
            }
            Err(_) => bad_gateway(),
        }
    }
}

fn bad_gateway() -> Response<Full<Bytes>> {
    Response::builder()
        .status(502)
        .body(Full::new(Bytes::new()))
        .expect("response")
}
