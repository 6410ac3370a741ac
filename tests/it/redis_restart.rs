//! A Redis restart that loses its data (no persistence) while a write-back is in flight, in
//! front of a store without ETags: the document's commit slot, which orders commits there, is
//! gone with it. A proxy that saw Redis restart takes no commit slot until every write-back
//! that could have been in flight before has landed or failed, so no acknowledged write is lost.

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;

use crate::support::*;

/// The store each proxy writes to.
#[derive(Clone, Copy)]
enum Path {
    /// Through a front that holds every PUT 3 s.
    Slow,
    /// Straight to the store.
    Direct,
}

/// Two proxies, one Redis without persistence, a store without ETags (checking fencing
/// tokens when `enforce_fencing`). A writes turn 10 through the slow front; 0.5 s later Redis
/// is killed and started again empty; 0.9 s later B writes turn 11 of the same session along
/// `b_path`. Every write acknowledged must be in the store.
async fn restart_during_a_write_back(enforce_fencing: bool, b_path: Path) {
    let mut redis = RedisServer::start();
    let mut store_args = turnlock::store::StoreArgs::local();
    store_args.no_etags = true;
    store_args.enforce_fencing = enforce_fencing;
    let store = turnlock::store::start(store_args).await.expect("start store");
    let slow = front_store(store.addr, PutDelay::Every(Duration::from_secs(3))).await;
    let with = |upstream: SocketAddr| {
        let mut args = proxy_args(upstream, Some(&redis));
        // A write-back may take 3 s; a write waits long enough to outlive the slot's life.
        args.upstream_timeout_ms = 4000;
        args.lock_ttl_ms = 1000;
        args.wait_deadline_ms = 15_000;
        args.lock_budget_ms = 15_000;
        args
    };
    let proxy_a = proxy(with(slow)).await;
    let proxy_b = proxy(with(match b_path {
        Path::Slow => slow,
        Path::Direct => store.addr,
    }))
    .await;
    let (a, b, direct) = (client(proxy_a.addr), client(proxy_b.addr), client(store.addr));
    // Both proxies are connected to Redis before it restarts.
    assert_eq!(append(&a, "warm-a", 1, "warm-a").await.status, StatusCode::CREATED);
    assert_eq!(append(&b, "warm-b", 1, "warm-b").await.status, StatusCode::CREATED);
    assert_eq!(append(&b, "s", 9, "seed-9").await.status, StatusCode::CREATED);

    let first = {
        let a = a.clone();
        tokio::spawn(async move { append(&a, "s", 10, "a-10").await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let restarted = tokio::task::spawn_blocking(move || {
        redis.restart();
        redis
    });
    let redis = restarted.await.expect("restart Redis");
    tokio::time::sleep(Duration::from_millis(900)).await;
    let second = append(&b, "s", 11, "b-11").await;
    let first = first.await.expect("A's write");

    let mut acked = Vec::new();
    for (id, r) in [("a-10", &first), ("b-11", &second)] {
        eprintln!("{id}: {} {}", r.status, r.json);
        // Waiting out the restart is answered as a commit in flight at worst, never an error.
        assert!(
            r.status.is_success() || r.status == StatusCode::CONFLICT || r.status == StatusCode::SERVICE_UNAVAILABLE,
            "{id}: {} {}",
            r.status,
            r.json
        );
        if r.status.is_success() {
            acked.push(id);
        }
    }
    let stored = message_ids(&get_doc(&direct, "s").await.json);
    let lost: Vec<_> = acked.iter().filter(|id| !stored.iter().any(|s| s == *id)).collect();
    eprintln!(
        "redis restart (enforce fencing {enforce_fencing}): {} acknowledged, {} lost; stored {stored:?}",
        acked.len(),
        lost.len()
    );
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}; stored {stored:?}");
    assert_eq!(acked.len(), 2, "both writes wait within their deadline and are stored");
    // The proxy that wrote after the restart noticed it, and says so.
    let seen = proxy_b.metrics.encode();
    assert!(
        seen.lines().any(|l| l == "turnlock_redis_restarts_seen_total 1"),
        "restart not counted: {}",
        seen.lines()
            .filter(|l| l.contains("restarts"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    drop(redis);
}

/// B writes straight to the store: without the restart check its write lands first and A's
/// late write-back, based on an older read, overwrites it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restart_during_a_write_back_loses_no_acknowledged_write() {
    restart_during_a_write_back(false, Path::Direct).await;
}

/// Both write-backs are held 3 s, and the store refuses older fencing tokens: A's write (the
/// older grant) lands first, and without the restart check B's (the newer grant, based on a
/// read made before A's landed) overwrites it. Fencing tokens do not order this; the commit
/// slot does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restart_loses_no_acknowledged_write_with_a_store_enforcing_fencing() {
    restart_during_a_write_back(true, Path::Slow).await;
}
