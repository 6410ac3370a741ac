//! The cross-cutting layers around the agent-facing service, outermost first: a panic made a
//! `500` JSON answer (`tower-http`'s catch-panic), a trace span per request (`tower-http`'s
//! trace, at debug level), and the request counter read from the answer's extensions.
//!
//! Body limits and the body timeout stay with the write's parsing (`request`): their limit
//! depends on the route (a whole document may be larger than other bodies) and their
//! refusals are JSON answers with their own codes, which a generic layer would not give.

use std::any::Any;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use tower::util::BoxCloneService;
use tower::{Layer, Service, ServiceBuilder};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

use crate::http::{Body, BoxError};
use crate::metrics::{ErrorCode, Metrics, RouteName};

/// The body of every answer the stack gives (catch-panic boxes it once more).
pub type StackBody = tower_http::body::UnsyncBoxBody<Bytes, BoxError>;

/// The agent-facing service with its layers, boxed so its type stays readable.
pub type Stack<B> = BoxCloneService<Request<B>, Response<StackBody>, Infallible>;

/// Wraps `inner` (the routing service) in the layers listed in this module's comment.
pub fn stack<S, B>(metrics: Metrics, inner: S) -> Stack<B>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
{
    let service = ServiceBuilder::new()
        .layer(CatchPanicLayer::custom(panic_answer))
        // Failures are logged by the write log line and the error map; no second log here.
        .layer(TraceLayer::new_for_http().on_failure(()))
        .layer(RequestMetrics::layer(metrics))
        .service(inner);
    BoxCloneService::new(service)
}

/// The answer to a request whose handler panicked: the connection and the process go on.
fn panic_answer(panic: Box<dyn Any + Send + 'static>) -> Response<Body> {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    tracing::error!(panic = %what, "a request handler panicked");
    super::EdgeError::Panic.into_response()
}

/// Counts each answer in `turnlock_requests_total` by its route, status and error code.
#[derive(Clone)]
pub struct RequestMetrics<S> {
    inner: S,
    metrics: Metrics,
}

// === impl RequestMetrics ===

impl<S> RequestMetrics<S> {
    pub fn layer(metrics: Metrics) -> impl Layer<S, Service = Self> + Clone {
        tower::layer::layer_fn(move |inner| Self {
            inner,
            metrics: metrics.clone(),
        })
    }
}

impl<S, B> Service<Request<B>> for RequestMetrics<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let answer = self.inner.call(req);
        let metrics = self.metrics.clone();
        let arrived = std::time::Instant::now();
        Box::pin(async move {
            let res = answer.await?;
            if let Some(route) = res.extensions().get::<RouteName>() {
                let code = res.extensions().get::<ErrorCode>().map_or("", |c| c.0);
                metrics.request(route.0, res.status().as_u16(), code);
                if !matches!(route.0, "forward" | "ambiguous") {
                    metrics.write_answered(arrived.elapsed());
                }
            }
            Ok(res)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;
    use tower::ServiceExt;

    fn answer(route: Option<&'static str>, status: StatusCode, code: Option<&'static str>) -> Response<Body> {
        let mut res = Response::new(crate::http::empty());
        *res.status_mut() = status;
        if let Some(route) = route {
            res.extensions_mut().insert(RouteName(route));
        }
        if let Some(code) = code {
            res.extensions_mut().insert(ErrorCode(code));
        }
        res
    }

    #[tokio::test]
    async fn answers_are_counted_by_route_status_and_code_and_unnamed_ones_are_not() {
        let metrics = Metrics::new();
        let inner = tower::service_fn(|req: Request<Body>| async move {
            Ok::<_, Infallible>(match req.uri().path() {
                "/write" => answer(Some("append"), StatusCode::CONFLICT, Some("stale_turn")),
                "/read" => answer(Some("forward"), StatusCode::OK, None),
                _ => answer(None, StatusCode::BAD_GATEWAY, None),
            })
        });
        let service = stack(metrics.clone(), inner);
        for path in ["/write", "/read", "/read", "/unnamed"] {
            let req = Request::get(path).body(crate::http::empty()).expect("request");
            service.clone().oneshot(req).await.expect("infallible");
        }
        let text = metrics.encode();
        assert!(
            text.contains(r#"turnlock_requests_total{route="append",status="409",error="stale_turn"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"turnlock_requests_total{route="forward",status="200",error=""} 2"#),
            "{text}"
        );
        assert!(!text.contains(r#"status="502""#), "{text}");
    }

    #[tokio::test]
    async fn a_panic_is_a_500_json_answer() {
        let inner = tower::service_fn(|_: Request<Body>| async move {
            if true {
                panic!("handler bug");
            }
            Ok::<_, Infallible>(answer(None, StatusCode::OK, None))
        });
        let res = stack(Metrics::new(), inner)
            .oneshot(Request::get("/").body(crate::http::empty()).expect("request"))
            .await
            .expect("infallible");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = http_body_util::BodyExt::collect(res.into_body())
            .await
            .expect("body")
            .to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(body["error"], "internal");
    }
}
