//! A fault-injecting TCP relay on loopback: put it between a proxy and Redis (or the store, or
//! the agent) and it can blackhole the link, drop every connection, or act on HTTP requests
//! and responses passing through (hold, delay, fail, reset, lose the answer).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

/// The state of the link as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// Bytes flow.
    Pass,
    /// Nothing gets through, nothing is refused: connects succeed, bytes stall (a partition).
    Blackhole,
    /// Every open connection is closed, and new ones are closed at once.
    Refuse,
}

/// What happens to an HTTP `PUT` going from the client side to the server side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnPut {
    Pass,
    /// Kept in the relay until [`Relay::release_held`] (or dropped by [`Relay::drop_held`]).
    Hold,
    /// Forwarded after this delay.
    Delay(Duration),
    /// Answered by the relay with a 500; the server never sees it.
    Fail500,
    /// The connection is reset; the server never sees it.
    Reset,
    /// The next PUT's connection is reset (the server never sees it); the rule is then `Pass`.
    ResetOnce,
    /// The next PUT reaches the server, and its connection is closed when the answer comes
    /// (the client never sees it); the rule is then `Pass`.
    LoseAnswerOnce,
}

pub struct Relay {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

struct Shared {
    target: SocketAddr,
    link: watch::Sender<Link>,
    /// Bumped to close every open connection.
    epoch: watch::Sender<u64>,
    /// Bumped to let held PUTs through.
    gate: watch::Sender<u64>,
    on_put: Mutex<OnPut>,
    held: AtomicUsize,
    held_changed: Notify,
    /// Lose every n-th HTTP response (0: none), closing its connection.
    lose_every: AtomicUsize,
    responses: AtomicUsize,
    pub lost_responses: AtomicUsize,
}

impl Relay {
    /// A relay on a free loopback port to `target`.
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().expect("relay addr");
        let shared = Arc::new(Shared {
            target,
            link: watch::channel(Link::Pass).0,
            epoch: watch::channel(0).0,
            gate: watch::channel(0).0,
            on_put: Mutex::new(OnPut::Pass),
            held: AtomicUsize::new(0),
            held_changed: Notify::new(),
            lose_every: AtomicUsize::new(0),
            responses: AtomicUsize::new(0),
            lost_responses: AtomicUsize::new(0),
        });
        let stop = CancellationToken::new();
        tokio::spawn(accept_loop(listener, shared.clone(), stop.clone()));
        Relay { addr, shared, stop }
    }

    pub fn url(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.addr)
    }

    pub fn set_link(&self, link: Link) {
        self.shared.link.send_replace(link);
        if link == Link::Refuse {
            self.cut_all();
        }
    }

    /// Closes every open connection (new ones are accepted as the link allows).
    pub fn cut_all(&self) {
        self.shared.epoch.send_modify(|e| *e += 1);
    }

    pub fn on_put(&self, rule: OnPut) {
        *self.shared.on_put.lock().expect("relay rule") = rule;
    }

    pub fn lose_every_nth_response(&self, n: usize) {
        self.shared.lose_every.store(n, Ordering::SeqCst);
    }

    pub fn lost_responses(&self) -> usize {
        self.shared.lost_responses.load(Ordering::SeqCst)
    }

    pub fn held(&self) -> usize {
        self.shared.held.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` PUTs are held, for `timeout` at the most.
    pub async fn wait_held(&self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.shared.held_changed.notified();
            if self.held() >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.held() >= n;
            }
        }
    }

    /// Lets every held PUT through to the server.
    pub fn release_held(&self) {
        self.on_put(OnPut::Pass);
        self.shared.gate.send_modify(|g| *g += 1);
    }

    /// Drops every held PUT with its connection: the server never sees them.
    pub fn drop_held(&self) {
        self.on_put(OnPut::Pass);
        self.cut_all();
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.cancel();
        self.cut_all();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(_) => continue,
            },
        };
        if *shared.link.borrow() == Link::Refuse {
            drop(stream);
            continue;
        }
        tokio::spawn(connection(stream, shared.clone()));
    }
}

async fn connection(client: TcpStream, shared: Arc<Shared>) {
    let mut epoch = shared.epoch.subscribe();
    epoch.mark_unchanged();
    let conn = CancellationToken::new();
    // A connection made during a partition waits for the link before reaching the server.
    if !wait_link(&shared, &mut epoch, &conn).await {
        return;
    }
    let server = match TcpStream::connect(shared.target).await {
        Ok(s) => s,
        Err(_) => return,
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_r, client_w) = client.into_split();
    let (server_r, server_w) = server.into_split();
    let client_w = Arc::new(tokio::sync::Mutex::new(client_w));
    // Set when this connection's next answer is to be lost.
    let lose_answer = Arc::new(AtomicBool::new(false));
    let up = pump(
        client_r,
        Out::Server(server_w),
        client_w.clone(),
        (shared.clone(), lose_answer.clone()),
        conn.clone(),
        true,
    );
    let down = pump(
        server_r,
        Out::Client(client_w.clone()),
        client_w,
        (shared.clone(), lose_answer),
        conn.clone(),
        false,
    );
    tokio::select! {
        _ = up => {},
        _ = down => {},
        _ = epoch.changed() => {},
    }
    conn.cancel();
}

enum Out {
    Server(OwnedWriteHalf),
    Client(Arc<tokio::sync::Mutex<OwnedWriteHalf>>),
}

impl Out {
    async fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Out::Server(w) => w.write_all(bytes).await,
            Out::Client(w) => w.lock().await.write_all(bytes).await,
        }
    }
}

/// Waits while the link is blackholed; false when the connection should end.
async fn wait_link(shared: &Shared, epoch: &mut watch::Receiver<u64>, conn: &CancellationToken) -> bool {
    let mut link = shared.link.subscribe();
    loop {
        match *link.borrow_and_update() {
            Link::Pass => return true,
            Link::Refuse => return false,
            Link::Blackhole => {}
        }
        tokio::select! {
            r = link.changed() => if r.is_err() { return false },
            _ = epoch.changed() => return false,
            _ = conn.cancelled() => return false,
        }
    }
}

async fn pump(
    mut from: OwnedReadHalf,
    mut to: Out,
    client_w: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    (shared, lose_answer): (Arc<Shared>, Arc<AtomicBool>),
    conn: CancellationToken,
    to_server: bool,
) {
    let mut epoch = shared.epoch.subscribe();
    epoch.mark_unchanged();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => return, Ok(n) => n },
            _ = conn.cancelled() => return,
            _ = epoch.changed() => return,
        };
        if !wait_link(&shared, &mut epoch, &conn).await {
            return;
        }
        let chunk = &buf[..n];
        if to_server && chunk.starts_with(b"PUT ") {
            let rule = {
                let mut rule = shared.on_put.lock().expect("relay rule");
                let now = *rule;
                if matches!(now, OnPut::ResetOnce | OnPut::LoseAnswerOnce) {
                    *rule = OnPut::Pass;
                }
                now
            };
            match rule {
                OnPut::Pass => {}
                OnPut::LoseAnswerOnce => lose_answer.store(true, Ordering::SeqCst),
                OnPut::Hold => {
                    let mut gate = shared.gate.subscribe();
                    gate.mark_unchanged();
                    shared.held.fetch_add(1, Ordering::SeqCst);
                    shared.held_changed.notify_waiters();
                    let released = tokio::select! {
                        r = gate.changed() => r.is_ok(),
                        _ = conn.cancelled() => false,
                        _ = epoch.changed() => false,
                    };
                    shared.held.fetch_sub(1, Ordering::SeqCst);
                    shared.held_changed.notify_waiters();
                    if !released {
                        return;
                    }
                }
                OnPut::Delay(d) => {
                    tokio::select! {
                        _ = tokio::time::sleep(d) => {},
                        _ = conn.cancelled() => return,
                        _ = epoch.changed() => return,
                    }
                }
                OnPut::Fail500 => {
                    let body = r#"{"error":"injected","message":"injected failure"}"#;
                    let res = format!(
                        "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let mut w = client_w.lock().await;
                    let _ = w.write_all(res.as_bytes()).await;
                    let _ = w.shutdown().await;
                    conn.cancel();
                    return;
                }
                OnPut::Reset | OnPut::ResetOnce => {
                    let w = client_w.lock().await;
                    #[allow(deprecated)]
                    let _ = w.as_ref().set_linger(Some(Duration::ZERO));
                    conn.cancel();
                    return;
                }
            }
        }
        if !to_server && chunk.starts_with(b"HTTP/1.") && lose_answer.swap(false, Ordering::SeqCst) {
            shared.lost_responses.fetch_add(1, Ordering::SeqCst);
            conn.cancel();
            return;
        }
        if !to_server && chunk.starts_with(b"HTTP/1.") {
            let every = shared.lose_every.load(Ordering::SeqCst);
            let nth = shared.responses.fetch_add(1, Ordering::SeqCst) + 1;
            if every > 0 && nth % every == 0 {
                shared.lost_responses.fetch_add(1, Ordering::SeqCst);
                conn.cancel();
                return;
            }
        }
        if to.write(chunk).await.is_err() {
            return;
        }
    }
}
