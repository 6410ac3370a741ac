//! What every request to the agent-facing service goes through, in one layer ([`Edge`], with
//! a concrete future: nothing boxed or cloned per request): a panic made a `500` JSON answer
//! (the connection and the process go on), a trace span per request when debug logging is on,
//! and the request counter read from the answer's extensions (an answer naming no route was
//! forwarded).
//!
//! Body limits and the body timeout stay with the write's parsing (`request`): their limit
//! depends on the route (a whole document may be larger than other bodies) and their
//! refusals are JSON answers with their own codes, which a generic layer would not give.

use std::any::Any;
use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::util::BoxCloneService;
use tower::Service;

use crate::http::Body;
use crate::metrics::{ErrorCode, Metrics, RouteName};

/// The body of every answer the stack gives.
pub type StackBody = Body;

/// The agent-facing service with its layers, boxed so its type stays readable (for callers
/// in the same process; the server runs [`Edge`] unboxed).
pub type Stack<B> = BoxCloneService<Request<B>, Response<StackBody>, Infallible>;

/// Wraps `inner` (the routing service) in [`Edge`], boxed.
pub fn stack<S, B>(metrics: Metrics, inner: S) -> Stack<B>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
{
    BoxCloneService::new(Edge::new(metrics, inner))
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

/// The layer around the routing service; see the module's documentation.
#[derive(Clone)]
pub struct Edge<S> {
    inner: S,
    metrics: Metrics,
}

// === impl Edge ===

impl<S> Edge<S> {
    pub fn new(metrics: Metrics, inner: S) -> Self {
        Self { inner, metrics }
    }
}

impl<S, B> Service<Request<B>> for Edge<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Answering<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // A span only when debug logging is on: none is made (nor its fields read) otherwise.
        let span = if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!("request", method = %req.method(), uri = %req.uri(), version = ?req.version())
        } else {
            tracing::Span::none()
        };
        let arrived = std::time::Instant::now();
        let answer = match span.in_scope(|| std::panic::catch_unwind(AssertUnwindSafe(|| self.inner.call(req)))) {
            Ok(answer) => State::Waiting { answer },
            Err(panic) => State::Panicked {
                answer: Some(span.in_scope(|| panic_answer(panic))),
            },
        };
        Answering {
            state: answer,
            metrics: self.metrics.clone(),
            arrived,
            span,
        }
    }
}

pin_project_lite::pin_project! {
    /// An answer on its way: a panic while it is made becomes a `500`, and the answer is
    /// counted when it comes ([`Edge`]).
    pub struct Answering<F> {
        #[pin]
        state: State<F>,
        metrics: Metrics,
        arrived: std::time::Instant,
        span: tracing::Span,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F> {
        Waiting { #[pin] answer: F },
        Panicked { answer: Option<Response<Body>> },
    }
}

impl<F> Future for Answering<F>
where
    F: Future<Output = Result<Response<Body>, Infallible>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let _entered = this.span.enter();
        let res = match this.state.project() {
            StateProj::Waiting { answer } => match std::panic::catch_unwind(AssertUnwindSafe(|| answer.poll(cx))) {
                Ok(Poll::Pending) => return Poll::Pending,
                Ok(Poll::Ready(Ok(res))) => res,
                Err(panic) => return Poll::Ready(Ok(panic_answer(panic))),
            },
            StateProj::Panicked { answer } => {
                return Poll::Ready(Ok(answer
                    .take()
                    .unwrap_or_else(|| super::EdgeError::Panic.into_response())));
            }
        };
        let route = res.extensions().get::<RouteName>().map_or("forward", |r| r.0);
        let code = res.extensions().get::<ErrorCode>().map_or("", |c| c.0);
        this.metrics.request(route, res.status().as_u16(), code);
        if !matches!(route, "forward" | "ambiguous") {
            this.metrics.write_answered(this.arrived.elapsed());
        }
        tracing::debug!(status = res.status().as_u16(), latency = ?this.arrived.elapsed(), "answered");
        Poll::Ready(Ok(res))
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
    async fn answers_are_counted_by_route_status_and_code_and_unnamed_ones_as_forwarded() {
        let metrics = Metrics::new();
        let inner = tower::service_fn(|req: Request<Body>| async move {
            Ok::<_, Infallible>(match req.uri().path() {
                "/write" => answer(Some("append"), StatusCode::CONFLICT, Some("stale_turn")),
                "/read" => answer(None, StatusCode::OK, None),
                _ => answer(None, StatusCode::BAD_GATEWAY, Some("upstream_unavailable")),
            })
        });
        let service = stack(metrics.clone(), inner);
        for path in ["/write", "/read", "/read", "/unreachable"] {
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
        assert!(
            text.contains(r#"turnlock_requests_total{route="forward",status="502",error="upstream_unavailable"} 1"#),
            "{text}"
        );
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

    #[tokio::test]
    async fn a_panic_before_the_answer_future_exists_is_a_500_too() {
        #[derive(Clone)]
        struct PanicsInCall;
        impl Service<Request<Body>> for PanicsInCall {
            type Response = Response<Body>;
            type Error = Infallible;
            type Future = std::future::Ready<Result<Response<Body>, Infallible>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, _: Request<Body>) -> Self::Future {
                panic!("call bug")
            }
        }
        let metrics = Metrics::new();
        let res = stack(metrics.clone(), PanicsInCall)
            .oneshot(Request::get("/").body(crate::http::empty()).expect("request"))
            .await
            .expect("infallible");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
