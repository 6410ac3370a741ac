//! What an operator meets: readiness through a Redis outage, a hung Redis told apart from
//! contention, a shutdown bounded by its grace, keep-alive clients during the drain, and a
//! store that closes idle connections silently.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::ledger::*;
use crate::support::relay::{OnPut, Relay};
use crate::support::*;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use turnlock::client::JsonClient;

async fn admin_get(admin: SocketAddr, path: &str) -> (u16, String) {
    let c = JsonClient::new(format!("http://{admin}"));
    match tokio::time::timeout(Duration::from_secs(3), c.send(http::Method::GET, path, None, &[])).await {
        Ok(Ok(r)) => (r.status.as_u16(), String::from_utf8_lossy(&r.body).into_owned()),
        _ => (0, String::new()),
    }
}

/// Waits (bounded) for a child to exit; its exit code and how long it took.
fn wait_exit(child: &mut std::process::Child, limit: Duration) -> (Option<i32>, Duration) {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Ok(Some(status)) = child.try_wait() {
            return (status.code(), started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    (None, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_keeps_the_sidecar_ready_reads_flowing_and_shows_in_status() {
    let store = store().await;
    let mut redis = RedisServer::start();
    let proxy = ProxyProc::spawn(&format!("http://{}", store.addr), Some(&redis.url()), &[]);
    let client = proxy.client();
    let ok = try_append(&client, "outage-1", 1, "m1", true, &[])
        .await
        .expect("write");
    assert!(ok.status.is_success(), "{}", String::from_utf8_lossy(&ok.body));
    assert_eq!(readyz(proxy.admin).await, 200);

    redis.kill();
    // Well past the background check period: readiness must not follow Redis.
    let mut seen_down = false;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            readyz(proxy.admin).await,
            200,
            "a Redis outage made the sidecar not ready"
        );
        let (code, body) = admin_get(proxy.admin, "/status").await;
        assert_eq!(code, 200);
        let status: Value = serde_json::from_str(&body).expect("status json");
        if status["dependencies"]["redis"]["up"] == Value::Bool(false) {
            assert!(status["dependencies"]["redis"]["error"].is_string(), "{status}");
            assert_eq!(status["dependencies"]["store"]["up"], Value::Bool(true), "{status}");
            seen_down = true;
        }
    }
    assert!(seen_down, "/status never showed Redis down");
    let (_, metrics) = admin_get(proxy.admin, "/metrics").await;
    assert!(
        metrics.contains(r#"turnlock_dependency_up{dependency="redis"} 0"#),
        "{metrics}"
    );
    // Reads pass through; a write fails fast with a clear code.
    let read = get_doc(&client, "outage-1").await;
    assert_eq!(read.status, 200);
    let started = Instant::now();
    let refused = try_append(&client, "outage-1", 2, "m2", true, &[])
        .await
        .expect("write");
    assert_eq!(refused.status, 503);
    assert_eq!(refused.json["error"], "lock_unavailable", "{}", refused.json);
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    let (_, metrics) = admin_get(proxy.admin, "/metrics").await;
    let failures: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("turnlock_redis_errors_total{"))
        .collect();
    assert!(
        failures.iter().any(|l| l.contains(r#"op="try_acquire""#)),
        "Redis failures not counted by operation: {failures:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_is_answered_lock_unavailable_not_session_busy() {
    let store = store().await;
    let redis = RedisServer::start();
    let proxy = ProxyProc::spawn(&format!("http://{}", store.addr), Some(&redis.url()), &[]);
    let client = proxy.client();
    let ok = try_append(&client, "hung-1", 1, "m1", true, &[]).await.expect("write");
    assert!(ok.status.is_success());

    redis.signal("STOP");
    let mut codes = Vec::new();
    for i in 0..6u64 {
        let r = try_append(&client, &format!("hung-{i}"), 2, &format!("x{i}"), true, &[]).await;
        codes.push(
            r.map(|r| r.json["error"].as_str().unwrap_or("").to_owned())
                .unwrap_or_default(),
        );
    }
    // Writers of one session at once, now and once Redis has been silent for seconds: those
    // waiting behind their session's leader were kept waiting by Redis too.
    for round in 0..2 {
        if round == 1 {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let writers: Vec<_> = (0..12u64)
            .map(|i| {
                let client = client.clone();
                tokio::spawn(
                    async move { try_append(&client, "hung-hot", 3, &format!("h{round}-{i}"), true, &[]).await },
                )
            })
            .collect();
        for w in writers {
            let r = w.await.expect("writer");
            codes.push(
                r.map(|r| r.json["error"].as_str().unwrap_or("").to_owned())
                    .unwrap_or_default(),
            );
        }
    }
    redis.signal("CONT");
    assert!(
        codes.iter().all(|c| c == "lock_unavailable"),
        "a hung Redis was answered {codes:?}"
    );
    let (_, metrics) = admin_get(proxy.admin, "/metrics").await;
    assert!(
        metrics.contains(r#"status="503",error="lock_unavailable"} 30"#),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"error="session_busy""#), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_a_hung_redis_and_held_writes_ends_within_the_grace_and_says_so() {
    let store = store().await;
    let relay = Relay::start(store.addr).await;
    let redis = RedisServer::start();
    let proxy = ProxyProc::spawn(&relay.url("http"), Some(&redis.url()), &["--shutdown-grace-ms", "1000"]);
    relay.on_put(OnPut::Hold);
    let client = proxy.client();
    let writers: Vec<_> = (0..8u64)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move { try_append(&client, &format!("drain-{i}"), 1, "m", true, &[]).await })
        })
        .collect();
    assert!(
        relay.wait_held(8, Duration::from_secs(10)).await,
        "writes did not reach the store"
    );
    let (_, metrics) = admin_get(proxy.admin, "/metrics").await;
    assert!(metrics.contains("turnlock_writes_in_flight 8"), "{metrics}");
    redis.signal("STOP");
    let mut proc = proxy.proc;
    let started = Instant::now();
    proc.signal("TERM");
    let (code, _) = wait_exit(&mut proc.child, Duration::from_secs(20));
    let took = started.elapsed();
    redis.signal("CONT");
    relay.release_held();
    for w in writers {
        let _ = w.await;
    }
    println!("shutdown with grace 1000 ms, hung Redis, 8 held writes: exit {code:?} after {took:?}");
    assert!(
        took <= Duration::from_millis(2000),
        "shutdown took {took:?} with a 1 s grace"
    );
    assert_eq!(code, Some(70), "abandoned writes must not exit 0");
}

/// Writes that finish within the grace but whose locks cannot be given back (Redis hung) leave
/// those locks to expire: the shutdown is not clean, and the exit code says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_that_could_not_be_released_at_shutdown_are_not_a_clean_exit() {
    let store = store().await;
    let relay = Relay::start(store.addr).await;
    let redis = RedisServer::start();
    let proxy = ProxyProc::spawn(&relay.url("http"), Some(&redis.url()), &["--shutdown-grace-ms", "4000"]);
    relay.on_put(OnPut::Hold);
    let client = proxy.client();
    let writers: Vec<_> = (0..4u64)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move { try_append(&client, &format!("left-{i}"), 1, "m", true, &[]).await })
        })
        .collect();
    assert!(
        relay.wait_held(4, Duration::from_secs(10)).await,
        "writes did not reach the store"
    );
    redis.signal("STOP");
    let mut proc = proxy.proc;
    proc.signal("TERM");
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The store answers: every write is answered within the grace, but no lock goes back.
    relay.release_held();
    let mut answered = 0;
    for w in writers {
        if let Ok(Ok(r)) = w.await {
            answered += usize::from(r.status.is_success());
        }
    }
    let (code, _) = wait_exit(&mut proc.child, Duration::from_secs(20));
    redis.signal("CONT");
    assert_eq!(answered, 4, "the writes were answered");
    assert_eq!(code, Some(70), "locks left to expire must not exit 0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once() {
    let store = store().await;
    let relay = Relay::start(store.addr).await;
    let redis = RedisServer::start();
    let proxy = ProxyProc::spawn(
        &relay.url("http"),
        Some(&redis.url()),
        &["--shutdown-grace-ms", "30000"],
    );
    relay.on_put(OnPut::Hold);
    let client = proxy.client();
    let writer = tokio::spawn(async move { try_append(&client, "second-1", 1, "m", true, &[]).await });
    assert!(relay.wait_held(1, Duration::from_secs(10)).await);
    let mut proc = proxy.proc;
    proc.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    proc.signal("INT");
    let (code, _) = wait_exit(&mut proc.child, Duration::from_secs(10));
    let took = started.elapsed();
    relay.release_held();
    let _ = writer.await;
    assert_eq!(code, Some(130));
    assert!(took < Duration::from_secs(1), "second signal took {took:?}");
}

/// A log reader that went away (stderr a closed pipe) must not keep the proxy from stopping.
#[test]
fn sigterm_stops_the_proxy_when_its_log_pipe_is_gone() {
    let (port, admin) = (free_port(), free_port());
    let mut child = std::process::Command::new(turnlock_bin())
        .args([
            "proxy",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin",
            &format!("127.0.0.1:{admin}"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start turnlock");
    wait_for_port(admin, Duration::from_secs(10));
    drop(child.stderr.take());
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let (code, _) = wait_exit(&mut child, Duration::from_secs(5));
    assert_eq!(code, Some(0), "the proxy did not stop on SIGTERM with its stderr gone");
}

/// A log reader that stalls (stderr a pipe nobody reads, full) costs log lines, never the
/// proxy: requests keep being answered and SIGTERM still stops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_log_reader_never_stops_the_proxy() {
    let store = store().await;
    let (port, admin) = (free_port(), free_port());
    let mut child = std::process::Command::new(turnlock_bin())
        .args([
            "proxy",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin",
            &format!("127.0.0.1:{admin}"),
            "--upstream",
            &format!("http://{}", store.addr),
        ])
        .env("RUST_LOG", "trace")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start turnlock");
    // The pipe is kept open and never read: once its buffer is full, every write to it blocks.
    let _unread = child.stderr.take();
    wait_for_port(port, Duration::from_secs(10));
    let agent = client(format!("127.0.0.1:{port}").parse().expect("addr"));
    let mut answered = 0;
    for i in 0..400 {
        let r = tokio::time::timeout(
            Duration::from_secs(2),
            try_append(&agent, &format!("log-{i}"), 1, "m", true, &[]),
        )
        .await;
        if !matches!(r, Ok(Ok(ref r)) if r.status.is_success()) {
            break;
        }
        answered += 1;
    }
    let (status, _) = admin_get(format!("127.0.0.1:{admin}").parse().expect("addr"), "/healthz").await;
    let status_code = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status_code.success());
    let (code, _) = wait_exit(&mut child, Duration::from_secs(5));
    assert_eq!(answered, 400, "writes went unanswered while the log pipe was full");
    assert_eq!(status, 200, "/healthz did not answer while the log pipe was full");
    assert_eq!(
        code,
        Some(0),
        "SIGTERM did not stop the proxy while the log pipe was full"
    );
}

/// One keep-alive client: sends GETs on one connection until told to stop or the server
/// says `Connection: close`; counts connections that ended under a request.
async fn keep_alive_client(addr: SocketAddr, stop: Arc<std::sync::atomic::AtomicBool>, cut: Arc<AtomicUsize>) {
    let Ok(mut conn) = tokio::net::TcpStream::connect(addr).await else {
        return;
    };
    for _ in 0..100_000 {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let req = b"GET /v1/sessions/ka HTTP/1.1\r\nHost: x\r\n\r\n";
        if conn.write_all(req).await.is_err() {
            cut.fetch_add(1, Ordering::SeqCst);
            return;
        }
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        loop {
            match tokio::time::timeout(Duration::from_secs(5), conn.read(&mut byte)).await {
                Ok(Ok(1)) => head.push(byte[0]),
                _ => {
                    cut.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
            if head.ends_with(b"\r\n\r\n") {
                break;
            }
        }
        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        if conn.read_exact(&mut body).await.is_err() {
            cut.fetch_add(1, Ordering::SeqCst);
            return;
        }
        if head.contains("connection: close") {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_clients_racing_the_drain_are_answered_connection_close_not_cut() {
    let store = store().await;
    let mut args = proxy_args(store.addr, None);
    args.shutdown_grace_ms = 2000;
    let running = proxy(args).await;
    let addr = running.addr;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cut = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..48)
        .map(|_| tokio::spawn(keep_alive_client(addr, stop.clone(), cut.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let token = running.shutdown_token();
    token.cancel();
    let stopped = tokio::spawn(running.wait());
    for c in clients {
        let _ = tokio::time::timeout(Duration::from_secs(10), c).await;
    }
    stop.store(true, Ordering::SeqCst);
    let _ = tokio::time::timeout(Duration::from_secs(10), stopped).await;
    assert_eq!(
        cut.load(Ordering::SeqCst),
        0,
        "keep-alive connections cut under a request"
    );
}

/// A store that answers the first request of each connection and closes the connection when
/// the next one arrives, without answering (an idle connection closed silently); or, with
/// `close_reused` false, a plain keep-alive store. Counts the connections open that carried
/// a request other than the health check's `GET /`, and the most open at once.
struct TinyStore {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

impl TinyStore {
    async fn start(close_reused: bool, delay: Duration) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let open = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let (o, p) = (open.clone(), peak.clone());
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (open, peak) = (o.clone(), p.clone());
                tokio::spawn(async move {
                    let mut counted = false;
                    for served in 0..10_000 {
                        let Some(request) = read_request_line(&mut conn).await else {
                            break;
                        };
                        if !counted && !request.starts_with("GET / ") {
                            counted = true;
                            let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                            peak.fetch_max(now, Ordering::SeqCst);
                        }
                        if close_reused && served > 0 {
                            break;
                        }
                        tokio::time::sleep(delay).await;
                        let body = r#"{"messages":[]}"#;
                        let res = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if conn.write_all(res.as_bytes()).await.is_err() {
                            break;
                        }
                    }
                    if counted {
                        open.fetch_sub(1, Ordering::SeqCst);
                    }
                });
            }
        });
        Self { addr, open, peak }
    }
}

/// Reads a request head; gives its first line.
async fn read_request_line(conn: &mut tokio::net::TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match conn.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
        if head.len() > 64 * 1024 {
            return None;
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    head.lines().next().map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_closes_idle_connections_silently_causes_no_502_on_reads() {
    let tiny = TinyStore::start(true, Duration::ZERO).await;
    let running = proxy(proxy_args(tiny.addr, None)).await;
    let client = client(running.addr);
    let mut statuses = Vec::new();
    for _ in 0..20 {
        let r = get_doc(&client, "stale-1").await;
        statuses.push(r.status.as_u16());
    }
    assert!(statuses.iter().all(|s| *s == 200), "reads failed: {statuses:?}");
    let text = running.metrics.encode();
    assert!(text.contains("turnlock_upstream_retries_total"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_closes_idle_connections_silently_is_not_reported_down() {
    let tiny = TinyStore::start(true, Duration::ZERO).await;
    let running = proxy(proxy_args(tiny.addr, None)).await;
    let store_down = r#"turnlock_dependency_up{dependency="store"} 0"#;
    let store_up = r#"turnlock_dependency_up{dependency="store"} 1"#;
    let mut seen_up = false;
    // Three health checks or more, each after the first on a pooled connection the store
    // closes when the check arrives on it.
    for _ in 0..35 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let text = running.metrics.encode();
        assert!(
            !text.contains(store_down),
            "a closed pooled connection was reported as an outage"
        );
        seen_up |= text.contains(store_up);
    }
    assert!(seen_up, "the store was never checked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_pool_is_capped_and_idle_connections_are_reaped() {
    let tiny = TinyStore::start(false, Duration::from_millis(100)).await;
    let mut args = proxy_args(tiny.addr, None);
    args.upstream_max_connections = 4;
    args.upstream_idle_timeout_ms = 300;
    let running = proxy(args).await;
    let readers: Vec<_> = (0..40)
        .map(|i| {
            let client = client(running.addr);
            tokio::spawn(async move { get_doc(&client, &format!("pool-{i}")).await.status.as_u16() })
        })
        .collect();
    for r in readers {
        assert_eq!(r.await.expect("reader"), 200);
    }
    let peak = tiny.peak.load(Ordering::SeqCst);
    assert!(peak <= 4, "{peak} store connections open at once with a cap of 4");
    let reaped = eventually(Duration::from_secs(5), Duration::from_millis(50), || {
        let open = tiny.open.clone();
        async move { open.load(Ordering::SeqCst) == 0 }
    })
    .await;
    assert!(
        reaped.is_some(),
        "{} idle store connections still open past the idle timeout",
        tiny.open.load(Ordering::SeqCst)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_at_the_store_connection_cap_are_served_in_the_order_they_came() {
    // 4 connections, 100 ms per answer, 40 readers each reading 3 times in a row: served in
    // the order they came, no read waits behind more than the 39 others (10 rounds, about
    // 1 s); a read passed over by later ones again and again waits several times that.
    let tiny = TinyStore::start(false, Duration::from_millis(100)).await;
    let mut args = proxy_args(tiny.addr, None);
    args.upstream_max_connections = 4;
    args.upstream_timeout_ms = 20_000;
    let running = proxy(args).await;
    let readers: Vec<_> = (0..40)
        .map(|i| {
            let client = client(running.addr);
            tokio::spawn(async move {
                let mut slowest = Duration::ZERO;
                for round in 0..3 {
                    let started = Instant::now();
                    let status = get_doc(&client, &format!("fifo-{i}-{round}")).await.status.as_u16();
                    assert_eq!(status, 200);
                    slowest = slowest.max(started.elapsed());
                }
                slowest
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for r in readers {
        slowest = slowest.max(r.await.expect("reader"));
    }
    assert!(
        slowest < Duration::from_millis(1600),
        "a read through 4 connections (100 ms each) beside 39 other readers waited {slowest:?}"
    );
}

/// A store whose answer to `GET /slow` takes 2 s to arrive (its head at once, then one body
/// byte every 200 ms), holding its connection meanwhile; any other request is answered at once.
async fn slow_body_store() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let store = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                loop {
                    let Some(request) = read_request_line(&mut conn).await else {
                        return;
                    };
                    // The health check's `GET /` is answered at once.
                    let slow = request.starts_with("GET /slow ");
                    let head = if slow {
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 10\r\n\r\n"
                    } else {
                        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
                    };
                    if conn.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    for _ in 0..if slow { 10 } else { 0 } {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        if conn.write_all(b"x").await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    store
}

/// A raw `GET /slow` through the proxy at `addr` (holding one of its store connections for
/// 2 s): its whole answer, as text.
fn slow_read(addr: SocketAddr) -> tokio::task::JoinHandle<String> {
    tokio::spawn(async move {
        let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
        conn.write_all(b"GET /slow HTTP/1.1\r\nhost: store\r\nconnection: close\r\n\r\n")
            .await
            .expect("send");
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer)).await;
        String::from_utf8_lossy(&answer).into_owned()
    })
}

/// Whether a [`slow_read`] got its whole answer.
fn read_whole(answer: &str) -> bool {
    answer.starts_with("HTTP/1.1 200") && answer.ends_with("xxxxxxxxxx")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_connection_cap_in_full_use_is_not_a_store_outage() {
    // One connection, kept busy for 4 s by two slow reads in a row: the health checks (one a
    // second, each given up after 1 s) do not wait behind them, and the store stays up.
    let store = slow_body_store().await;
    let mut args = proxy_args(store, None);
    args.upstream_max_connections = 1;
    args.upstream_timeout_ms = 5000;
    let running = proxy(args).await;
    let store_up = r#"turnlock_dependency_up{dependency="store"} 1"#;
    let up = eventually(Duration::from_secs(3), Duration::from_millis(50), || {
        let text = running.metrics.encode();
        async move { text.contains(store_up) }
    })
    .await;
    assert!(up.is_some(), "the store was never checked");
    let holders: Vec<_> = (0..2).map(|_| slow_read(running.addr)).collect();
    let store_down = r#"turnlock_dependency_up{dependency="store"} 0"#;
    for _ in 0..35 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let text = running.metrics.encode();
        assert!(
            !text.contains(store_down),
            "a store connection cap in full use was reported as an outage"
        );
    }
    for holder in holders {
        let answer = holder.await.expect("holder");
        assert!(read_whole(&answer), "{answer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_gets_no_store_connection_in_time_says_so_and_that_nothing_was_written() {
    // One connection, held by an answer whose body takes 2 s to arrive: the next read and
    // write wait for it until the timeout, and were never sent.
    let store = slow_body_store().await;
    let mut args = proxy_args(store, None);
    args.upstream_max_connections = 1;
    args.upstream_timeout_ms = 500;
    let running = proxy(args).await;
    let holder = slow_read(running.addr);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let client = client(running.addr);
    let started = Instant::now();
    let (read, write) = tokio::join!(
        get_doc(&client, "slot-read"),
        try_append(&client, "slot-write", 1, "m1", true, &[])
    );
    let write = write.expect("an answer to the write");
    let took = started.elapsed();
    let held = holder.await.expect("holder");
    assert!(
        took < Duration::from_millis(1500),
        "{:?}: held {held:?} read {} {}, write {} {}",
        took,
        read.status,
        read.json,
        write.status,
        write.json
    );
    for (what, status, json) in [("read", read.status, &read.json), ("write", write.status, &write.json)] {
        assert_eq!(status.as_u16(), 502, "{what}: {json}");
        assert_eq!(json["error"], "upstream_unavailable", "{what}: {json}");
        let message = json["message"].as_str().unwrap_or_default();
        assert!(message.contains("--upstream-max-connections"), "{what}: {message}");
    }
    let message = write.json["message"].as_str().unwrap_or_default();
    assert!(message.contains("nothing was written"), "{message}");
    assert!(read_whole(&held), "{held}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_store_connection_does_not_cut_the_store_s_time_to_answer() {
    // One store connection, a store taking 400 ms per write-back, a 700 ms timeout, three
    // writers of three sessions at once: the second write-back waits 400 ms for the
    // connection and is answered 400 ms after it was sent. Its answer is the store's (the
    // write was applied), not a 504 with its outcome unknown; the third gets no connection
    // in time and was never sent.
    let store = store().await;
    let front = front_store(store.addr, PutDelay::Every(Duration::from_millis(400))).await;
    let mut args = proxy_args(front, None);
    args.upstream_max_connections = 1;
    args.upstream_timeout_ms = 700;
    let running = proxy(args).await;
    let through = client(running.addr);
    let writes = (0..3).map(|i| {
        let through = through.clone();
        async move { try_append(&through, &format!("wait-{i}"), 1, &format!("m{i}"), true, &[]).await }
    });
    let answers = futures_util::future::join_all(writes).await;
    let direct = client(store.addr);
    let mut applied = 0;
    for (i, answer) in answers.into_iter().enumerate() {
        let answer = answer.expect("an answer");
        let stored = get_doc(&direct, &format!("wait-{i}")).await;
        let present = stored.status == 200
            && stored.json["messages"]
                .as_array()
                .is_some_and(|m| m.iter().any(|m| m["id"] == format!("m{i}")));
        match answer.status.as_u16() {
            200 | 201 => {
                assert!(present, "write {i} acknowledged but not stored");
                applied += 1;
            }
            502 => {
                assert!(
                    !present,
                    "write {i} answered as not written, but stored: {}",
                    answer.json
                );
                let message = answer.json["message"].as_str().unwrap_or_default();
                assert!(message.contains("nothing was written"), "{message}");
            }
            other => panic!("write {i} answered {other} {} (stored: {present})", answer.json),
        }
    }
    assert!(applied >= 2, "only {applied} of 3 writes applied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_at_the_store_connection_cap_queues_once_not_for_its_read_and_again_for_its_write_back() {
    // One connection, 100 ms per request, five reads queued while a write reads its
    // document: the write-back goes out on the read's connection (about 200 ms in all), not
    // behind the five reads (about 700 ms), its lock held all the while.
    let store = store().await;
    let front = front_store(store.addr, PutDelay::All(Duration::from_millis(100))).await;
    let mut args = proxy_args(front, None);
    args.upstream_max_connections = 1;
    let running = proxy(args).await;
    let through = client(running.addr);
    let writer = {
        let through = through.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let reply = try_append(&through, "queued-once", 1, "w1", true, &[]).await;
            (reply, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    let readers: Vec<_> = (0..5)
        .map(|i| {
            let through = through.clone();
            tokio::spawn(async move { get_doc(&through, &format!("reader-{i}")).await.status.as_u16() })
        })
        .collect();
    let (reply, took) = writer.await.expect("writer");
    let reply = reply.expect("an answer");
    assert!(reply.status.is_success(), "{} {}", reply.status, reply.json);
    for r in readers {
        assert_eq!(r.await.expect("reader"), 404);
    }
    assert!(
        took < Duration::from_millis(450),
        "the write took {took:?}: its write-back queued behind the reads"
    );
}

#[test]
fn health_subcommand_gives_up_before_the_image_healthcheck_does() {
    // A listener that accepts and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("addr").to_string();
    let started = Instant::now();
    let out = Command::new(turnlock_bin())
        .args(["health", "--admin", &addr])
        .output()
        .expect("health");
    assert!(!out.status.success());
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_write_is_logged_once_at_info_failures_warn_rate_limited_and_no_colours_in_files() {
    let store = store().await;
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let log_path = dir.path().join("proxy.log");
    let (proc, addr) = Proc::logged_proxy(store.addr, &["--redis", &redis.url()], &log_path);
    let client = client(addr);
    for turn in 1..=3u64 {
        let r = try_append(&client, "logged-1", turn, &format!("m{turn}"), true, &[])
            .await
            .expect("write");
        assert!(r.status.is_success());
    }
    redis.kill();
    for turn in 4..=23u64 {
        let _ = try_append(&client, "logged-1", turn, &format!("m{turn}"), true, &[]).await;
    }
    proc.signal("TERM");
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(proc);
    let text = std::fs::read_to_string(&log_path).expect("read log");
    assert!(!text.contains('\u{1b}'), "ANSI colours written to a file");
    let writes: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("INFO") && l.contains(" write route="))
        .filter(|l| l.contains(r#"session="logged-1""#))
        .collect();
    let ok = writes.iter().filter(|l| l.contains(r#"outcome="ok""#)).count();
    let failed = writes.iter().filter(|l| l.contains("lock_unavailable")).count();
    assert_eq!((ok, failed), (3, 20), "one info line per write:\n{text}");
    assert!(writes.iter().all(|l| l.contains("turn=")), "{text}");
    let warnings = text
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("writes failing"))
        .count();
    assert!(warnings <= 2, "{warnings} WARN lines for 20 failing writes:\n{text}");
}

/// A relay in front of a real store that closes a connection idle for `idle` since its last
/// answer, silently: the close is noticed only when the next request arrives on it, which is
/// then neither forwarded nor answered (a store or load balancer whose FIN was lost, or that
/// drops idle connections without closing them cleanly).
async fn silently_closing_relay(target: SocketAddr, idle: Duration) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let answered: Arc<std::sync::Mutex<Option<Instant>>> = Arc::default();
                let seen = answered.clone();
                let back = tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    while let Ok(n) = sr.read(&mut buf).await {
                        if n == 0 || cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        *seen.lock().expect("relay state") = Some(Instant::now());
                    }
                });
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n) = cr.read(&mut buf).await {
                    let stale = answered
                        .lock()
                        .expect("relay state")
                        .is_some_and(|t| t.elapsed() >= idle);
                    if n == 0 || stale || sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                back.abort();
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_succeed_when_the_store_closes_idle_connections_silently() {
    let store = store().await;
    let relay = silently_closing_relay(store.addr, Duration::from_millis(50)).await;
    let running = proxy(proxy_args(relay, None)).await;
    let client = client(running.addr);
    let mut statuses = Vec::new();
    for turn in 1..=10u64 {
        tokio::time::sleep(Duration::from_millis(80)).await;
        let r = try_append(&client, "stale-write", turn, &format!("m{turn}"), true, &[])
            .await
            .map(|r| (r.status.as_u16(), r.json["error"].as_str().unwrap_or("").to_owned()))
            .unwrap_or((0, String::new()));
        statuses.push(r);
    }
    assert!(
        statuses.iter().all(|(s, _)| (200..300).contains(s)),
        "writes failed: {statuses:?}"
    );
    let ids = message_ids(
        &get_doc(
            &turnlock::client::JsonClient::new(format!("http://{}", store.addr)),
            "stale-write",
        )
        .await
        .json,
    );
    assert_eq!(ids.len(), 10, "{ids:?}");
}

/// Every store exchange of a write is counted in `upstream_responses_total`, as forwarded
/// ones are: a DELETE by its status, and a write that got no connection to the store at all
/// as `op="connect"`, status 0 (the alert on `status="0"` sees a store down for writes too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_traffic_of_writes_is_counted_by_op_and_status() {
    let store = store().await;
    let redis = RedisServer::start();
    let proxy = ProxyProc::spawn(&format!("http://{}", store.addr), Some(&redis.url()), &[]);
    let client = proxy.client();
    let ok = try_append(&client, "counted-1", 1, "m1", true, &[])
        .await
        .expect("write");
    assert!(ok.status.is_success(), "{}", String::from_utf8_lossy(&ok.body));
    let r = client
        .send(http::Method::DELETE, "/v1/sessions/counted-1", None, &[])
        .await
        .expect("delete");
    assert!(r.status.is_success(), "{}", r.json);
    let (_, metrics) = admin_get(proxy.admin, "/metrics").await;
    let deletes: f64 = metrics
        .lines()
        .filter(|l| l.starts_with(r#"turnlock_upstream_responses_total{op="delete",status="2"#))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(deletes, 1.0, "{metrics}");

    // No store at all: the write is answered 502 and counted.
    let nobody = free_port();
    let down = ProxyProc::spawn(&format!("http://127.0.0.1:{nobody}"), Some(&redis.url()), &[]);
    let r = try_append(&down.client(), "counted-2", 1, "m1", true, &[])
        .await
        .expect("answer");
    assert_eq!(r.status.as_u16(), 502, "{}", String::from_utf8_lossy(&r.body));
    let (_, metrics) = admin_get(down.admin, "/metrics").await;
    assert!(
        metric(
            &metrics,
            r#"turnlock_upstream_responses_total{op="connect",status="0"}"#
        ) >= 1.0,
        "{metrics}"
    );
}

/// Requests the HTTP parser answers itself (a head too large, a malformed header line) never
/// reach the proxy's service: they are counted in `requests_total` as route `unparsed`, as
/// any other answer, and so is a head cut after the head timeout (status 0, unanswered). An
/// HTTP/2 preface, closed unanswered, is not a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_of_the_http_parser_are_counted() {
    let s = store().await;
    let running = proxy(proxy_args(s.addr, None)).await;
    let addr = running.addr;
    let raw = move |bytes: Vec<u8>| async move {
        let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let _ = conn.write_all(&bytes).await;
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut answer)).await;
        String::from_utf8_lossy(&answer).into_owned()
    };
    // A head that stops half-way is cut after the head timeout (10 s), unanswered.
    let stalled = tokio::spawn(async move {
        let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
        conn.write_all(b"GET /v1/sessions/a HTTP/1.1\r\nhost: st")
            .await
            .expect("send");
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(15), conn.read_to_end(&mut answer)).await;
        (read.is_ok(), answer)
    });
    let big = format!(
        "GET /v1/sessions/a HTTP/1.1\r\nhost: store\r\nx-big: {}\r\n\r\n",
        "y".repeat(70_000)
    );
    // Only the count is checked: the client's unread bytes may reset the connection first.
    let _ = raw(big.into_bytes()).await;
    let answer = raw(b"GET /v1/sessions/a HTTP/1.1\r\nhost: store\r\nbad header\r\n\r\n".to_vec()).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let _ = raw(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec()).await;
    let cut = tokio::time::timeout(Duration::from_secs(20), stalled).await;
    assert!(
        matches!(cut, Ok(Ok((true, ref answer))) if answer.is_empty()),
        "{cut:?}"
    );
    let text = running.metrics.encode();
    let mut unparsed: Vec<&str> = text.lines().filter(|l| l.contains(r#"route="unparsed""#)).collect();
    unparsed.sort_unstable();
    assert_eq!(
        unparsed,
        [
            r#"turnlock_requests_total{route="unparsed",status="0",error="head_timeout"} 1"#,
            r#"turnlock_requests_total{route="unparsed",status="400",error="malformed_request"} 1"#,
            r#"turnlock_requests_total{route="unparsed",status="431",error="head_too_large"} 1"#,
        ],
        "{text}"
    );
    running.stop().await;
    s.stop().await;
}

/// Redis stalled (SIGSTOP) while a session's writes asked for its lock: the acquires it had
/// not answered are carried out once it resumes, granting locks and commit slots that no
/// writer is left to release. The sidecar gives them back, so the session is written again
/// soon after Redis answers, not a lease and a slot's life (7 s) later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_written_during_a_redis_stall_is_written_again_soon_after_it_resumes() {
    let store = store().await;
    let redis = RedisServer::start();
    let proxy = ProxyProc::spawn(&format!("http://{}", store.addr), Some(&redis.url()), &[]);
    let client = proxy.client();
    let ok = try_append(&client, "stall", 1, "m0", true, &[]).await.expect("write");
    assert!(ok.status.is_success(), "{:?}", ok.json);
    redis.signal("STOP");
    for i in 0..4 {
        let r = try_append(&client, "stall", 1, &format!("s{i}"), true, &[])
            .await
            .expect("answer");
        assert_eq!(r.json["error"], "lock_unavailable", "{:?}", r.json);
    }
    redis.signal("CONT");
    let took = first_write_from(&client, "stall", 1).await;
    println!("session written again {took:?} after Redis resumed");
    assert!(
        took < Duration::from_secs(2),
        "the session waited {took:?} for locks granted late"
    );
}

/// An idempotent write whose claim Redis did not answer in time (stalled) is answered
/// `lock_unavailable`, nothing applied; the claim Redis stores once it resumes is dropped
/// again, so a retry with the same key is applied at once instead of answered
/// `request_in_progress` for the claim's whole life (about two minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_redis_stall_is_not_held_by_a_claim_stored_late() {
    let store = store().await;
    let redis = RedisServer::start();
    let proxy = ProxyProc::spawn(&format!("http://{}", store.addr), Some(&redis.url()), &[]);
    let client = proxy.client();
    let ok = try_append(&client, "claimed", 1, "m0", true, &[]).await.expect("write");
    assert!(ok.status.is_success(), "{:?}", ok.json);
    let key = [("idempotency-key", "stalled-claim".to_owned())];
    redis.signal("STOP");
    let r = try_append(&client, "claimed", 2, "k", true, &key)
        .await
        .expect("answer");
    assert_eq!(r.status, 503, "{:?}", r.json);
    redis.signal("CONT");
    let resumed = Instant::now();
    let mut applied = None;
    for _ in 0..40 {
        let r = try_append(&client, "claimed", 2, "k", true, &key)
            .await
            .expect("answer");
        if r.status.is_success() {
            applied = Some(resumed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = applied.expect("the retry was never applied");
    println!("retry with the same key applied {took:?} after Redis resumed");
    assert!(took < Duration::from_secs(3), "the retry waited {took:?}");
}

/// A lock release Redis drops (`CLIENT PAUSE`: a connection given up on while Redis is paused
/// is closed with its command unrun) is sent again once Redis answers: the document's commit
/// slot goes back then, not after its whole life (7 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_redis_dropped_while_paused_is_sent_again() {
    let store = store().await;
    let relay = Relay::start(store.addr).await;
    let redis = RedisServer::start();
    let proxy = ProxyProc::spawn(&relay.url("http"), Some(&redis.url()), &[]);
    let client = proxy.client();
    let ok = try_append(&client, "paused", 1, "m0", true, &[]).await.expect("write");
    assert!(ok.status.is_success(), "{:?}", ok.json);
    relay.on_put(OnPut::Hold);
    let writer = {
        let client = client.clone();
        tokio::spawn(async move { try_append(&client, "paused", 2, "m1", true, &[]).await })
    };
    assert!(
        relay.wait_held(1, Duration::from_secs(10)).await,
        "the write-back did not come"
    );
    relay.on_put(OnPut::Pass);
    redis.cmd(&["CLIENT", "PAUSE", "2000", "ALL"]);
    let paused = Instant::now();
    relay.release_held();
    let r = writer.await.expect("writer").expect("answer");
    assert!(r.status.is_success(), "{:?}", r.json);
    tokio::time::sleep(Duration::from_millis(2000).saturating_sub(paused.elapsed())).await;
    let took = first_write_from(&client, "paused", 3).await;
    println!("session written again {took:?} after the pause ended");
    assert!(
        took < Duration::from_secs(2),
        "the session waited {took:?} for a dropped release"
    );
}

/// How long after now `session` is first written again (one-message appends at `turn`,
/// each waiting at most 200 ms for its turn, 50 ms apart, at most 100 of them).
async fn first_write_from(client: &JsonClient, session: &str, turn: u64) -> Duration {
    let started = Instant::now();
    let short = [("x-wait-deadline-ms", "200".to_owned())];
    for i in 0..100 {
        let r = try_append(client, session, turn, &format!("after-{i}"), true, &short)
            .await
            .expect("answer");
        if r.status.is_success() {
            return started.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the session was never written again");
}
