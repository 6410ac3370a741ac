//! An `https://` store: turnlock reaches it over TLS, verified against `--upstream-ca` (a test
//! CA) besides the system's roots, and refuses one it cannot verify.

use std::sync::Arc;

use http::{Method, Request};
use hyper::body::Incoming;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::json;
use tokio::net::TcpListener;
use turnlock::client::JsonClient;

use crate::support::{client, proxy, proxy_args, store, RedisServer};

/// A TLS front (certificate for `localhost`, signed by the returned CA) of the reference
/// store at `target`; returns its port and the CA's PEM.
async fn https_store(target: std::net::SocketAddr) -> (u16, String) {
    let gen = turnlock::inject::certs::generate(&["localhost".into(), "127.0.0.1".into()], 1).expect("certs");
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(gen.cert.as_bytes())
        .collect::<Result<_, _>>()
        .expect("cert");
    let key = PrivateKeyDer::from_pem_slice(gen.key.as_bytes()).expect("key");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let direct = JsonClient::new(format!("http://{target}"));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, direct) = (acceptor.clone(), direct.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let direct = direct.clone();
                    async move {
                        let res = crate::support::Forwarded::read(req).await.send(direct).await;
                        Ok::<_, std::convert::Infallible>(res)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (port, gen.ca_cert)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_reach_an_https_store_verified_with_the_given_ca() {
    let reference = store().await;
    let (port, ca) = https_store(reference.addr).await;
    let ca_file = tempfile::NamedTempFile::new().expect("temp");
    std::fs::write(ca_file.path(), ca).expect("write ca");
    let redis = RedisServer::start();
    let mut args = proxy_args(reference.addr, Some(&redis));
    args.upstream = format!("https://localhost:{port}");
    args.upstream_ca = Some(ca_file.path().to_owned());
    let p = proxy(args).await;
    let c = client(p.addr);
    let body = json!({"turn": 1, "messages": [{"id": "m1", "role": "user", "content": "over TLS"}]});
    let r = c
        .send(Method::POST, "/v1/sessions/t1/messages", Some(&body), &[])
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let r = c.send(Method::GET, "/v1/sessions/t1", None, &[]).await.expect("read");
    assert_eq!(r.status, 200);
    assert_eq!(r.json["messages"][0]["id"], "m1");
    // It is the TLS store that holds it.
    let direct = client(reference.addr);
    let r = direct
        .send(Method::GET, "/v1/sessions/t1", None, &[])
        .await
        .expect("direct");
    assert_eq!(r.json["messages"][0]["content"], "over TLS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_store_whose_certificate_cannot_be_verified_is_not_written() {
    let reference = store().await;
    let (port, _ca) = https_store(reference.addr).await;
    let mut args = proxy_args(reference.addr, None);
    args.upstream = format!("https://localhost:{port}");
    let p = proxy(args).await;
    let c = client(p.addr);
    let body = json!({"turn": 1, "messages": [{"id": "m1", "role": "user", "content": "x"}]});
    let r = c
        .send(Method::POST, "/v1/sessions/t1/messages", Some(&body), &[])
        .await
        .expect("write");
    assert_eq!(r.status, 502, "{:?}", r.json);
    let direct = client(reference.addr);
    let r = direct
        .send(Method::GET, "/v1/sessions/t1", None, &[])
        .await
        .expect("direct");
    assert_eq!(r.status, 404, "nothing reached the store");
}
