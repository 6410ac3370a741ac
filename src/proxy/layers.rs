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
use http::{Request, Response, StatusCode};
use tower::util::BoxCloneService;
use tower::{Layer, Service, ServiceBuilder};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

use crate::http::{error, Body, BoxError};
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
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "turnlock failed while handling this request",
        None,
    )
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
        Box::pin(async move {
            let res = answer.await?;
            if let Some(route) = res.extensions().get::<RouteName>() {
                let code = res.extensions().get::<ErrorCode>().map_or("", |c| c.0);
                metrics.request(route.0, res.status().as_u16(), code);
            }
            Ok(res)
        })
    }
}
