//! A small JSON-over-HTTP client for the demo and the benchmarks: what a simulated agent
//! replica uses to talk to the store or the sidecar.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::http::{full, Body, BoxError};

#[derive(Clone)]
pub struct JsonClient {
    client: Client<HttpConnector, Body>,
    base: String,
}

/// A response: status, headers, and the body parsed as JSON when it is JSON.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub json: Value,
}

impl JsonClient {
    pub fn new(base: impl Into<String>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Self {
            client,
            base: base.into(),
        }
    }

    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, String)],
    ) -> Result<Reply, BoxError> {
        let mut req = Request::builder().method(method).uri(format!("{}{}", self.base, path));
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let body = match body {
            Some(v) => {
                req = req.header("content-type", "application/json");
                full(serde_json::to_vec(v)?)
            }
            None => full(Bytes::new()),
        };
        let res = tokio::time::timeout(Duration::from_secs(10), self.client.request(req.body(body)?)).await??;
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = res.into_body().collect().await?.to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok(Reply {
            status,
            headers,
            body: bytes,
            json,
        })
    }
}
