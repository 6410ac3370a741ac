//! The admin server: `/metrics` (Prometheus text), `/healthz` (the process is up), `/readyz`
//! (this sidecar can serve: not shutting down) and `/status` (readiness plus each
//! dependency's last background check). No probe does I/O to Redis or the store. It binds to
//! loopback by default; there is deliberately no control endpoint.

use std::net::SocketAddr;
use std::time::Duration;

use crate::health::Health;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::http::{error, full, json, Body};
use crate::metrics::Metrics;

/// Serves the admin endpoints. Probes (`/healthz`, `/readyz`) answer any caller the listener
/// accepts, so a kubelet can reach them on the pod's address; `/metrics` answers loopback
/// callers only, unless `public_metrics` (for a Prometheus scraping the pod from elsewhere).
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    health: Health,
    public_metrics: bool,
    stop: CancellationToken,
) {
    let handler = move |req: Request<Incoming>, peer: SocketAddr| {
        let metrics = metrics.clone();
        let health = health.clone();
        async move {
            if !serves(req.uri().path(), peer.ip(), public_metrics) {
                return error(
                    StatusCode::FORBIDDEN,
                    "forbidden",
                    "/metrics answers loopback callers only; start the proxy with --admin-public-metrics to allow others",
                    None,
                );
            }
            handle(req, &metrics, &health)
        }
    };
    crate::server::serve(listener, handler, stop, Duration::from_secs(1)).await;
}

/// Whether `path` is served to a caller at `ip`: probes to anyone, metrics to loopback (or
/// anyone with `public_metrics`).
pub fn serves(path: &str, ip: std::net::IpAddr, public_metrics: bool) -> bool {
    path != "/metrics" || public_metrics || ip.to_canonical().is_loopback()
}

fn handle(req: Request<Incoming>, metrics: &Metrics, health: &Health) -> Response<Body> {
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
            let body = if ready {
                json!({"ready": true})
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
    use super::serves;

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
