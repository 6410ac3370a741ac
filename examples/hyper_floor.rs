//! The least an HTTP/1 proxy built on hyper does per request, as a floor for turnlock's
//! forward path: one thread, a hyper server connection per client, a list of hyper client
//! connections to the one store (take one that is ready, or open one), and no work on the
//! request or the answer at all: no header removed or added, no timeout, no retry, no
//! metrics. Not a proxy to run: it panics when the store cannot be reached.
//!
//!   cargo build --release --example hyper_floor
//!   target/release/examples/hyper_floor 127.0.0.1:22100 127.0.0.1:22080
//!
//! `scripts/forward-instructions.sh` counts its instructions per forwarded GET beside
//! turnlock's and nginx's.

use std::cell::RefCell;
use std::rc::Rc;

use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

type Connections = Rc<RefCell<Vec<SendRequest<Incoming>>>>;

/// A ready connection from the list, or a new one; put back as soon as the request is
/// handed to it (it is ready again once its answer has been read).
async fn forward(
    connections: Connections,
    store: &'static str,
    req: Request<Incoming>,
) -> Result<Response<Incoming>, hyper::Error> {
    let ready = {
        let mut list = connections.borrow_mut();
        list.retain(|c| !c.is_closed());
        list.iter().position(SendRequest::is_ready).map(|i| list.swap_remove(i))
    };
    let mut sender = match ready {
        Some(sender) => sender,
        None => {
            let stream = TcpStream::connect(store).await.expect("the store is reachable");
            stream.set_nodelay(true).expect("nodelay");
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::task::spawn_local(conn);
            sender
        }
    };
    let answer = sender.send_request(req);
    connections.borrow_mut().push(sender);
    answer.await
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(store)) = (args.next(), args.next()) else {
        eprintln!("usage: hyper_floor LISTEN_ADDR STORE_ADDR");
        std::process::exit(2);
    };
    let store: &'static str = Box::leak(store.into_boxed_str());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&runtime, async move {
        let listener = TcpListener::bind(&listen).await.expect("bind");
        let connections = Connections::default();
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            stream.set_nodelay(true).expect("nodelay");
            let connections = connections.clone();
            tokio::task::spawn_local(async move {
                let service = hyper::service::service_fn(move |req| forward(connections.clone(), store, req));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}
