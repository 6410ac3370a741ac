//! Fair order across proxies: a proxy whose writers keep its session's lock in demand does not
//! take every turn while the writers behind the other proxies wait, even when those proxies
//! are farther from Redis (they hear of a release later than the holder can ask again).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

/// A TCP relay to `target` that delays every chunk by `delay` in each direction: a Redis
/// farther away. Runs until the test ends.
async fn slow_link(target: SocketAddr, delay: Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(target).await else {
                continue;
            };
            let _ = (client.set_nodelay(true), server.set_nodelay(true));
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(pump(cr, sw, delay));
            tokio::spawn(pump(sr, cw, delay));
        }
    });
    addr
}

/// Copies `from` to `to`, each chunk after `delay` (chunks keep their order).
async fn pump(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, delay: Duration) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
    });
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0
            || tx
                .send((tokio::time::Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
        {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}

/// Proxy 0, next to Redis, has 24 writers of one session; proxies 1 and 2, 3 ms farther from
/// Redis each way, one writer each. Without a fair order proxy 0 asks again before the others
/// have even heard of its release, and takes nearly every turn; in the order the waiters
/// asked, each lone writer is answered about once per grant of proxy 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn proxies_farther_from_redis_still_get_their_turns() {
    let redis = RedisServer::start();
    let (_store, store_port) = Proc::store();
    let upstream = format!("http://127.0.0.1:{store_port}");
    let redis_addr: SocketAddr = redis
        .url()
        .trim_start_matches("redis://")
        .parse()
        .expect("redis address");
    let far = format!("redis://{}", slow_link(redis_addr, Duration::from_millis(3)).await);
    let proxies = [
        ProxyProc::spawn(&upstream, Some(&redis.url()), &[]),
        ProxyProc::spawn(&upstream, Some(&far), &[]),
        ProxyProc::spawn(&upstream, Some(&far), &[]),
    ];
    let (acked, busy) = run(&proxies, "far").await;
    let grants = metric(
        &metrics(proxies[0].admin).await,
        "turnlock_lock_acquire_total{outcome=\"acquired\"}",
    );
    println!(
        "fair order, far proxies: acknowledged per proxy {acked:?}, retryable {busy}, grants to proxy 0: {grants}"
    );
    assert!(grants > 20.0, "too few grants to judge: {grants}");
    for p in [1, 2] {
        assert!(
            acked[p] as f64 >= grants / 2.0,
            "proxy {p}'s writer was answered {} times while proxy 0 took {grants} grants: {acked:?}",
            acked[p]
        );
    }
    assert_eq!(busy, 0, "writes answered with a retryable 503");
}

/// Runs proxy 0's 24 writers and the lone writers of proxies 1 and 2 on `session` for 3 s;
/// returns the writes acknowledged per proxy, and the retryable answers.
async fn run(proxies: &[ProxyProc; 3], session: &str) -> ([usize; 3], usize) {
    let acked: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
    let busy = Arc::new(AtomicUsize::new(0));
    let end = tokio::time::Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for (p, writers) in [(0usize, 24usize), (1, 1), (2, 1)] {
        for w in 0..writers {
            let (client, acked, busy, session) = (proxies[p].client(), acked.clone(), busy.clone(), session.to_owned());
            tasks.push(tokio::spawn(async move {
                let mut n = 0;
                while tokio::time::Instant::now() < end && n < 100_000 {
                    n += 1;
                    let r = append(&client, &session, 1, &format!("p{p}-w{w}-{n}")).await;
                    if r.status.is_success() {
                        acked[p].fetch_add(1, Ordering::Relaxed);
                    } else if r.status == http::StatusCode::SERVICE_UNAVAILABLE {
                        busy.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("writer");
    }
    let acked = [0, 1, 2].map(|p| acked[p].load(Ordering::Relaxed));
    (acked, busy.load(Ordering::Relaxed))
}

/// Proxy 0 has 24 writers of one session, proxies 1 and 2 one writer each, all as near to
/// Redis: every proxy waiting takes its turn between two of proxy 0's grants.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_proxy_does_not_take_every_turn_of_a_session() {
    let redis = RedisServer::start();
    let (_store, store_port) = Proc::store();
    let upstream = format!("http://127.0.0.1:{store_port}");
    let proxies = [0, 1, 2].map(|_| ProxyProc::spawn(&upstream, Some(&redis.url()), &[]));
    let (acked, busy) = run(&proxies, "near").await;
    let grants = metric(
        &metrics(proxies[0].admin).await,
        "turnlock_lock_acquire_total{outcome=\"acquired\"}",
    );
    println!("fair order: acknowledged per proxy {acked:?}, retryable {busy}, grants to proxy 0: {grants}");
    assert!(grants > 20.0, "too few grants to judge: {grants}");
    for p in [1, 2] {
        assert!(
            acked[p] as f64 >= grants / 2.0,
            "proxy {p}'s writer was answered {} times while proxy 0 took {grants} grants: {acked:?}",
            acked[p]
        );
    }
    assert_eq!(busy, 0, "writes answered with a retryable 503");
}
