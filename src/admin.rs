//! The admin server: `/metrics` (Prometheus text), `/healthz` (the process is up), `/readyz`
//! (this sidecar can serve: not shutting down) and `/status` (readiness plus each
//! dependency's last background check). No probe does I/O to Redis or the store. It binds to
//! loopback by default; there is deliberately no control endpoint.

use std::convert::Infallible;
use std::time::Duration;

use crate::health::Health;

use http::{Method, Request, Response, StatusCode};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::http::{error, full, json, Body};
use crate::metrics::Metrics;
use crate::server::Conn;

/// Serves the admin endpoints (see [`Admin`]) until `stop` fires.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    health: Health,
    public_metrics: bool,
    stop: CancellationToken,
) {
    let admin = Admin {
        metrics,
        health,
        public_metrics,
        peer: None,
    };
    let make = move |conn: Conn| Admin {
        peer: Some(conn.peer.ip()),
        ..admin.clone()
    };
    crate::server::serve_with(listener, make, false, None, stop, Duration::from_secs(1)).await;
}

/// The admin endpoints as a service. Probes (`/healthz`, `/readyz`) answer any caller the
/// listener accepts, so a kubelet can reach them on the pod's address; `/metrics` answers
/// loopback callers only (the connection's peer, [`Admin::peer`]), unless
/// `public_metrics` (for a Prometheus scraping the pod from elsewhere). Readiness is a latch
/// read from [`Health`], never I/O per probe.
#[derive(Clone)]
pub struct Admin {
    pub metrics: Metrics,
    pub health: Health,
    pub public_metrics: bool,
    /// The caller's address: the connection's, else (a caller in the same process) the
    /// request's [`Conn`] extension when it has one.
    pub peer: Option<std::net::IpAddr>,
}

// === impl Admin ===

impl<B> tower::Service<Request<B>> for Admin {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let peer = self
            .peer
            .or_else(|| req.extensions().get::<Conn>().map(|c| c.peer.ip()));
        let allowed = peer.is_some_and(|ip| serves(req.uri().path(), ip, self.public_metrics))
            || (peer.is_none() && req.uri().path() != "/metrics");
        let res = if allowed {
            handle(&req, &self.metrics, &self.health)
        } else {
            error(
                StatusCode::FORBIDDEN,
                "forbidden",
                "/metrics answers loopback callers only; start the proxy with --admin-public-metrics to allow others",
                None,
            )
        };
        std::future::ready(Ok(res))
    }
}

/// Whether `path` is served to a caller at `ip`: probes to anyone, metrics to loopback (or
/// anyone with `public_metrics`).
pub fn serves(path: &str, ip: std::net::IpAddr, public_metrics: bool) -> bool {
    path != "/metrics" || public_metrics || ip.to_canonical().is_loopback()
}

fn handle<B>(req: &Request<B>, metrics: &Metrics, health: &Health) -> Response<Body> {
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
            let ready = health.ready();
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let down = health.down();
            let body = if ready && down.is_empty() {
                json!({"ready": true})
            } else if ready {
                // Still ready (reads pass through, writes fail fast), but say what is down and why.
                json!({"ready": true, "down": down})
            } else {
                json!({"ready": false, "reason": "shutting down"})
            };
            json(status, &body)
        }
        "/status" => json(StatusCode::OK, &health.status()),
        _ => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "admin endpoints: /metrics, /healthz, /readyz, /status",
            None,
        ),
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, Empty};
    use tower::ServiceExt;

    use super::*;

    fn admin(shutdown: &CancellationToken) -> Admin {
        Admin {
            metrics: Metrics::new(),
            health: Health::new(true, shutdown.clone()),
            public_metrics: false,
            peer: None,
        }
    }

    fn get(path: &str, peer: Option<&str>) -> Request<Empty<bytes::Bytes>> {
        let mut req = Request::get(path).body(Empty::new()).unwrap_or_default();
        if let Some(peer) = peer {
            req.extensions_mut().insert(Conn {
                peer: peer.parse().unwrap_or_else(|_| ([10, 0, 0, 1], 1).into()),
                original_dst: None,
            });
        }
        req
    }

    #[tokio::test]
    async fn readiness_is_a_latch_that_shutdown_drops() {
        let shutdown = CancellationToken::new();
        let admin = admin(&shutdown);
        let res = admin
            .clone()
            .oneshot(get("/readyz", None))
            .await
            .unwrap_or_else(|e| match e {});
        assert_eq!(res.status(), StatusCode::OK);
        shutdown.cancel();
        let res = admin
            .clone()
            .oneshot(get("/readyz", None))
            .await
            .unwrap_or_else(|e| match e {});
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = res
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        assert!(String::from_utf8_lossy(&body).contains("shutting down"));
        let live = admin
            .oneshot(get("/healthz", None))
            .await
            .unwrap_or_else(|e| match e {});
        assert_eq!(live.status(), StatusCode::OK, "liveness must not follow readiness");
    }

    #[tokio::test]
    async fn metrics_are_served_to_loopback_only_and_other_paths_are_404() {
        let admin = admin(&CancellationToken::new());
        let local = admin.clone().oneshot(get("/metrics", Some("127.0.0.1:5000"))).await;
        assert_eq!(local.map(|r| r.status()).ok(), Some(StatusCode::OK));
        let remote = admin.clone().oneshot(get("/metrics", Some("10.1.2.3:5000"))).await;
        assert_eq!(remote.map(|r| r.status()).ok(), Some(StatusCode::FORBIDDEN));
        let unknown = admin.clone().oneshot(get("/metrics", None)).await;
        assert_eq!(unknown.map(|r| r.status()).ok(), Some(StatusCode::FORBIDDEN));
        let missing = admin.oneshot(get("/nope", Some("127.0.0.1:5000"))).await;
        assert_eq!(missing.map(|r| r.status()).ok(), Some(StatusCode::NOT_FOUND));
    }

    #[test]
    fn metrics_answer_loopback_callers_unless_made_public_and_probes_answer_everyone() {
        let remote = "10.1.2.3".parse().unwrap();
        let mapped_loopback = "::ffff:127.0.0.1".parse().unwrap();
        assert!(serves("/metrics", "127.0.0.1".parse().unwrap(), false));
        assert!(serves("/metrics", mapped_loopback, false));
        assert!(!serves("/metrics", remote, false));
        assert!(serves("/metrics", remote, true));
        assert!(serves("/readyz", remote, false));
        assert!(serves("/healthz", remote, false));
    }
}
