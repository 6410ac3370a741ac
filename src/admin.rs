//! The admin server: `/metrics` (Prometheus text), `/healthz` (the process is up) and
//! `/readyz` (Redis, when configured, and the store both answer; not ready while shutting
//! down). It binds to loopback by default; `/shutdown`-style controls are deliberately absent.

use std::net::SocketAddr;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::http::{error, full, json, Body};
use crate::lock::Locks;
use crate::metrics::Metrics;
use crate::upstream::Upstream;

#[derive(Clone)]
pub struct Readiness {
    locks: Locks,
    /// `None` in transparent mode, where there is no single store to ask.
    upstream: Option<Upstream>,
    shutdown: CancellationToken,
}

impl Readiness {
    pub fn new(locks: Locks, upstream: Option<Upstream>, shutdown: CancellationToken) -> Self {
        Self {
            locks,
            upstream,
            shutdown,
        }
    }

    async fn check(&self) -> (bool, serde_json::Value) {
        if self.shutdown.is_cancelled() {
            return (false, json!({"ready": false, "reason": "shutting down"}));
        }
        let (redis, upstream) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(1), self.locks.ping()),
            tokio::time::timeout(Duration::from_secs(1), async {
                match &self.upstream {
                    Some(u) => u.ping().await,
                    None => true,
                }
            }),
        );
        let redis_ok = matches!(redis, Ok(Ok(())));
        let upstream_ok = matches!(upstream, Ok(true));
        let ready = redis_ok && upstream_ok;
        (
            ready,
            json!({"ready": ready, "lock_backend": redis_ok, "upstream": upstream_ok}),
        )
    }
}

pub async fn serve(listener: TcpListener, metrics: Metrics, readiness: Readiness, stop: CancellationToken) {
    let handler = move |req: Request<Incoming>, _peer: SocketAddr| {
        let metrics = metrics.clone();
        let readiness = readiness.clone();
        async move { handle(req, &metrics, &readiness).await }
    };
    crate::server::serve(listener, handler, stop, Duration::from_secs(1)).await;
}

async fn handle(req: Request<Incoming>, metrics: &Metrics, readiness: &Readiness) -> Response<Body> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "the admin server only answers GET",
            None,
        );
    }
    match req.uri().path() {
        "/metrics" => {
            let mut res = Response::new(full(metrics.encode()));
            res.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            );
            res
        }
        "/healthz" | "/live" => json(StatusCode::OK, &json!({"status": "ok"})),
        "/readyz" | "/ready" => {
            let (ready, body) = readiness.check().await;
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            json(status, &body)
        }
        _ => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "admin endpoints: /metrics, /healthz, /readyz",
            None,
        ),
    }
}
