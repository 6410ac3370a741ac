//! Proof under faults: each test injects one fault while concurrent writers run, then an
//! independent checker reads every session's final document straight from the store and
//! checks that no acknowledged write was lost or duplicated and no stale write got through.
//!
//! Everything runs on loopback: real `redis-server` processes (and a Sentinel), real
//! `turnlock proxy` processes that are paused and killed, and a fault-injecting TCP relay.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use turnlock::config::ProxyArgs;

use crate::support::ledger::*;
use crate::support::relay::{Link, OnPut, Relay};
use crate::support::*;

const LEASE_MS: u64 = 600;
const BUDGET_MS: u64 = 300;

/// Every lock is gone within a few leases (released, or expired after a fault).
async fn assert_no_locks_left(redis: &RedisServer) {
    let gone = eventually(lease() * 4, Duration::from_millis(50), || async {
        redis.lock_keys().is_empty()
    })
    .await;
    assert!(gone.is_some(), "locks left behind: {:?}", redis.lock_keys());
}

fn lease() -> Duration {
    Duration::from_millis(LEASE_MS)
}

fn args(upstream: &str, redis: &str) -> ProxyArgs {
    let mut a = ProxyArgs::local(upstream.to_owned());
    a.redis = Some(redis.to_owned());
    a.lock_ttl_ms = LEASE_MS;
    a.lock_budget_ms = BUDGET_MS;
    a
}

fn proc_flags() -> Vec<String> {
    vec![
        "--lock-ttl-ms".into(),
        LEASE_MS.to_string(),
        "--lock-budget-ms".into(),
        BUDGET_MS.to_string(),
    ]
}

fn flags(extra: &[String]) -> Vec<&str> {
    extra.iter().map(String::as_str).collect()
}

/// Writes one message until it is acknowledged (bounded), filing it in the ledger.
async fn write_until_acked(
    client: &turnlock::client::JsonClient,
    ledger: &Ledger,
    session: &str,
    turn: u64,
    token: &str,
) -> bool {
    let hint = AtomicU64::new(0);
    for _ in 0..100 {
        match try_append(client, session, turn, token, true, &[]).await {
            Ok(r) if r.status.is_success() => {
                record(ledger, &hint, session, turn, token, Ok(r));
                return true;
            }
            Ok(r) if r.status.is_client_error() => panic!("write refused: {} {}", r.status, r.json),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    ledger.unknown(session, token);
    false
}

/// Fault 1: A proxy process is paused (SIGSTOP) with a write in flight, for longer than the lease;
/// the others carry on; its late write must be refused, not applied over newer data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_holder_late_write_is_refused() {
    let redis = RedisServer::start();
    let store = store().await;
    let relay = Relay::start(store.addr).await;
    let extra = proc_flags();
    let a = ProxyProc::spawn(&relay.url("http"), Some(&redis.url()), &flags(&extra));
    let b = proxy(args(&format!("http://{}", store.addr), &redis.url())).await;
    let bc = client(b.addr);
    let all = sessions("paused", 4);
    let target = all[0].clone();
    let main = Ledger::default();
    assert!(write_until_acked(&bc, &main, &target, 1, "paused-seed").await);

    // A takes the lock, reads, and sends its write-back, which the network holds.
    relay.on_put(OnPut::Hold);
    let ac = a.client();
    let t = target.clone();
    let late = tokio::spawn(async move { try_append(&ac, &t, 1, "paused-late", true, &[]).await });
    assert!(relay.wait_held(1, Duration::from_secs(10)).await, "A never wrote back");
    a.proc.signal("STOP");

    // Others carry on while A is paused, past its lease.
    let writers = Writers::start(
        "paused",
        vec![bc.clone()],
        all[1..].to_vec(),
        4,
        400,
        Duration::from_secs(30),
    );
    tokio::time::sleep(lease() * 3).await;
    assert!(write_until_acked(&bc, &main, &target, 1, "paused-same-turn").await);
    assert!(write_until_acked(&bc, &main, &target, 2, "paused-turn-2").await);
    assert!(write_until_acked(&bc, &main, &target, 3, "paused-turn-3").await);

    // A's late write arrives at the store, then A resumes.
    relay.release_held();
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.proc.signal("CONT");
    let late = tokio::time::timeout(Duration::from_secs(20), late)
        .await
        .expect("the resumed proxy answers")
        .expect("task");
    let hint = AtomicU64::new(0);
    let late_status = late.as_ref().map(|r| r.status.as_u16()).unwrap_or(0);
    record(&main, &hint, &target, 1, "paused-late", late);
    let ledger = writers.finish().await;

    let counts = check(store.addr, &all, &[&main, &ledger]).await;
    report("paused holder (SIGSTOP past the lease)", &counts);
    assert!(
        !(200..300).contains(&late_status),
        "the paused holder's late write was acknowledged ({late_status})"
    );
    assert!(counts.clean(), "{counts:?}");
    assert!(ledger.acked_count() > 0, "no write went through during the pause");
    let doc = get_doc(&client(store.addr), &target).await.json;
    assert_eq!(doc["turn"], 3, "the stored turn moved backwards: {doc}");
    assert_no_locks_left(&redis).await;
    b.stop().await;
}

/// Fault 2: A proxy is killed (SIGKILL) while holding locks; the other proxies obtain those sessions
/// once the lease expires, with no manual cleanup, and the dead holder's in-flight writes,
/// delivered late, change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_holder_locks_are_taken_over_after_the_lease() {
    let redis = RedisServer::start();
    let store = store().await;
    let relay = Relay::start(store.addr).await;
    let extra = proc_flags();
    let a = ProxyProc::spawn(&relay.url("http"), Some(&redis.url()), &flags(&extra));
    let b = proxy(args(&format!("http://{}", store.addr), &redis.url())).await;
    let bc = client(b.addr);
    let all = sessions("crashed", 6);
    let held: Vec<String> = all[..3].to_vec();
    let main = Ledger::default();
    for s in &held {
        assert!(write_until_acked(&bc, &main, s, 1, &format!("{s}-seed")).await);
    }

    relay.on_put(OnPut::Hold);
    let mut pending = Vec::new();
    for s in &held {
        let (ac, s) = (a.client(), s.clone());
        pending.push(tokio::spawn(async move {
            try_append(&ac, &s, 1, &format!("{s}-dead"), true, &[]).await
        }));
    }
    assert!(
        relay.wait_held(held.len(), Duration::from_secs(10)).await,
        "A never held the locks"
    );
    assert!(
        redis.lock_keys().len() >= held.len(),
        "A holds no lock: {:?}",
        redis.lock_keys()
    );
    a.proc.signal("KILL");

    // The dead holder's sessions are written below, at the turn whose lock it held.
    let writers = Writers::start(
        "crashed",
        vec![bc.clone()],
        all[3..].to_vec(),
        4,
        400,
        Duration::from_secs(30),
    );
    let mut took_over = Vec::new();
    for s in &held {
        let took = eventually(lease() * 10, Duration::from_millis(20), || async {
            let r = try_append(&bc, s, 1, &format!("{s}-after"), true, &[]).await;
            let ok = matches!(&r, Ok(r) if r.status.is_success());
            let hint = AtomicU64::new(0);
            if ok {
                record(&main, &hint, s, 1, &format!("{s}-after"), r);
            }
            ok
        })
        .await;
        assert!(
            took.is_some(),
            "session {s} was never obtained again after the holder died"
        );
        took_over.push(took.unwrap_or_default());
    }
    eprintln!("sessions of the killed holder obtained again after {took_over:?} (lease {LEASE_MS} ms)");

    // The dead holder's write-backs, still in the network, arrive now.
    relay.release_held();
    for p in pending {
        let _ = tokio::time::timeout(Duration::from_secs(5), p).await;
        // The client connection died with A: these are never acknowledged.
    }
    for s in &held {
        main.unknown(s, &format!("{s}-dead"));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ledger = writers.finish().await;
    let counts = check(store.addr, &all, &[&main, &ledger]).await;
    report("crashed holder (SIGKILL with locks held)", &counts);
    assert!(counts.clean(), "{counts:?}");
    for s in &held {
        let doc = get_doc(&client(store.addr), s).await.json;
        let ids = message_ids(&doc);
        assert!(
            !ids.contains(&format!("{s}-dead")),
            "the dead holder's late write landed over newer data: {ids:?}"
        );
    }
    assert_no_locks_left(&redis).await;
    b.stop().await;
}

/// Fault 3: Redis restarts (empty) under load: writes fail cleanly while it is down, `/status`
/// shows it (the sidecar stays ready), and the proxies recover on their own once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_fails_writes_cleanly_and_recovers() {
    let mut redis = RedisServer::start();
    let store = store().await;
    let up = format!("http://{}", store.addr);
    let p1 = proxy(args(&up, &redis.url())).await;
    let p2 = proxy(args(&up, &redis.url())).await;
    let (c1, c2) = (client(p1.addr), client(p2.addr));
    let all = sessions("restart", 6);
    let writers = Writers::start(
        "restart",
        vec![c1.clone(), c2.clone()],
        all.clone(),
        6,
        2000,
        Duration::from_secs(60),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    redis.kill();
    let not_ready = eventually(Duration::from_secs(10), Duration::from_millis(50), || async {
        dependency_up(p1.admin, "redis").await == Some(false) && dependency_up(p2.admin, "redis").await == Some(false)
    })
    .await;
    assert!(not_ready.is_some(), "/status does not show Redis down");
    assert_eq!((readyz(p1.admin).await, readyz(p2.admin).await), (200, 200));
    for (i, c) in [&c1, &c2].into_iter().enumerate() {
        let r = try_append(c, &all[0], 1_000, &format!("restart-probe-{i}"), true, &[])
            .await
            .expect("the proxy answers while Redis is down");
        assert!(
            r.status.is_server_error(),
            "a write was answered {} with Redis down",
            r.status
        );
        assert!(r.json["error"].is_string(), "no JSON error: {}", r.json);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    redis.restart();
    let recovered = eventually(Duration::from_secs(20), Duration::from_millis(50), || async {
        let mut ok = true;
        for (i, c) in [&c1, &c2].into_iter().enumerate() {
            let s = format!("restart-recovery-{i}");
            let token = format!("restart-recovered-{i}-{}", rand::random::<u32>());
            ok &= matches!(try_append(c, &s, 1, &token, true, &[]).await, Ok(r) if r.status.is_success());
        }
        ok && dependency_up(p1.admin, "redis").await == Some(true)
            && dependency_up(p2.admin, "redis").await == Some(true)
    })
    .await;
    assert!(recovered.is_some(), "the proxies did not recover after Redis came back");
    eprintln!("recovered {:?} after Redis came back", recovered.unwrap_or_default());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ledger = writers.finish().await;
    let counts = check(store.addr, &all, &[&ledger]).await;
    report("Redis restart under load", &counts);
    assert!(
        counts.clean(),
        "{counts:?} (unexplained includes probes written while Redis was down)"
    );
    assert!(ledger.acked_count() > 0);
    assert_no_locks_left(&redis).await;
    p1.stop().await;
    p2.stop().await;
}

/// Fault 6: The network between one proxy and Redis is cut: first blackholed (nothing answers),
/// then every connection dropped. Same guarantees as a Redis restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_cut_to_redis_fails_writes_cleanly_and_recovers() {
    let redis = RedisServer::start();
    let store = store().await;
    let up = format!("http://{}", store.addr);
    let relay = Relay::start(std::net::SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let p1 = proxy(args(&up, &relay.url("redis"))).await;
    let p2 = proxy(args(&up, &redis.url())).await;
    let (c1, c2) = (client(p1.addr), client(p2.addr));
    let all = sessions("netcut", 6);
    let writers = Writers::start(
        "netcut",
        vec![c1.clone(), c2.clone()],
        all.clone(),
        6,
        3000,
        Duration::from_secs(60),
    );
    tokio::time::sleep(Duration::from_millis(500)).await;

    for (n, link) in [Link::Blackhole, Link::Refuse].into_iter().enumerate() {
        relay.set_link(link);
        let not_ready = eventually(Duration::from_secs(10), Duration::from_millis(50), || async {
            dependency_up(p1.admin, "redis").await == Some(false)
        })
        .await;
        assert!(
            not_ready.is_some(),
            "/status does not show Redis down with the link {link:?}"
        );
        assert_eq!(readyz(p1.admin).await, 200, "a Redis outage made the sidecar not ready");
        let r = try_append(&c1, &all[0], 1_000, &format!("netcut-probe-{n}"), true, &[])
            .await
            .expect("the proxy answers while cut off");
        assert!(
            r.status.is_server_error(),
            "a write was answered {} while cut off ({link:?})",
            r.status
        );
        // The other proxy is not affected.
        assert_eq!(dependency_up(p2.admin, "redis").await, Some(true));
        tokio::time::sleep(Duration::from_secs(1)).await;
        relay.set_link(Link::Pass);
        let recovered = eventually(Duration::from_secs(20), Duration::from_millis(50), || async {
            let token = format!("netcut-recovered-{n}-{}", rand::random::<u32>());
            matches!(try_append(&c1, "netcut-recovery", 1, &token, true, &[]).await, Ok(r) if r.status.is_success())
                && dependency_up(p1.admin, "redis").await == Some(true)
        })
        .await;
        assert!(recovered.is_some(), "no recovery after the {link:?} ended");
        eprintln!("recovered {:?} after the {link:?} ended", recovered.unwrap_or_default());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ledger = writers.finish().await;
    let counts = check(store.addr, &all, &[&ledger]).await;
    report("network cut proxy-Redis (blackhole, then dropped connections)", &counts);
    assert!(counts.clean(), "{counts:?}");
    assert!(ledger.acked_count() > 0);
    assert_no_locks_left(&redis).await;
    p1.stop().await;
    p2.stop().await;
}

/// Fault 5: The store is slow (longer than the lease), fails with 5xx, resets the connection, or
/// never answers: the sidecar renews or aborts, answers a clear 5xx, never acknowledges an
/// unconfirmed write, and leaves no lock behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_failing_upstream_never_acknowledges_unconfirmed_writes() {
    let redis = RedisServer::start();
    let store = store().await;
    let relay = Relay::start(store.addr).await;
    let mut faulty_args = args(&relay.url("http"), &redis.url());
    faulty_args.upstream_timeout_ms = LEASE_MS * 3;
    let faulty = proxy(faulty_args).await;
    let healthy = proxy(args(&format!("http://{}", store.addr), &redis.url())).await;
    let (fc, hc) = (client(faulty.addr), client(healthy.addr));
    let others = sessions("upstream-other", 4);
    let writers = Writers::start(
        "upstream",
        vec![hc.clone()],
        others.clone(),
        3,
        3000,
        Duration::from_secs(60),
    );
    let main = Ledger::default();
    let hint = AtomicU64::new(0);
    let sc = client(store.addr);

    let cases = [
        ("slow", OnPut::Delay(lease() * 2), Some(200u16), ""),
        ("fail500", OnPut::Fail500, Some(502), "upstream_error"),
        ("reset", OnPut::Reset, Some(502), "upstream_unavailable"),
        ("hang", OnPut::Hold, Some(504), "upstream_timeout"),
    ];
    let mut targets = Vec::new();
    for (name, rule, expect, code) in cases {
        let s = format!("upstream-{name}");
        targets.push(s.clone());
        assert!(write_until_acked(&hc, &main, &s, 1, &format!("{s}-seed")).await);
        relay.on_put(rule);
        let token = format!("{s}-write");
        let started = tokio::time::Instant::now();
        let (fc2, s2, t2) = (fc.clone(), s.clone(), token.clone());
        let write = tokio::spawn(async move { try_append(&fc2, &s2, 1, &t2, true, &[]).await });
        if name == "slow" {
            // Past the lease, the lock is still held: it was renewed.
            tokio::time::sleep(lease() + lease() / 2).await;
            let keys = redis.keys(&format!("turnlock:session:{{{s}}}:[0-9]*"));
            assert_eq!(keys.len(), 1, "the lock of a slow write was not kept past the lease");
        }
        let reply = tokio::time::timeout(Duration::from_secs(20), write)
            .await
            .expect("answered")
            .expect("task")
            .expect("an HTTP answer");
        let took = started.elapsed();
        if name == "hang" {
            relay.drop_held();
        }
        relay.on_put(OnPut::Pass);
        eprintln!("{name}: {} {} after {took:?}", reply.status, reply.json);
        assert_eq!(Some(reply.status.as_u16()), expect, "{name}: {}", reply.json);
        if !code.is_empty() {
            assert_eq!(reply.json["error"], code, "{name}: {}", reply.json);
        }
        let landed = message_ids(&get_doc(&sc, &s).await.json).contains(&token);
        if reply.status.is_success() {
            assert!(landed, "{name}: acknowledged but not stored");
            record(&main, &hint, &s, 1, &token, Ok(reply));
        } else {
            assert!(!landed, "{name}: answered {} but the write landed", reply.status);
        }
        assert!(
            redis.keys(&format!("turnlock:session:{{{s}}}:[0-9]*")).is_empty(),
            "{name}: the lock outlived the write"
        );
        // The session is writable again at once.
        assert!(write_until_acked(&fc, &main, &s, 1, &format!("{s}-after")).await);
    }
    let ledger = writers.finish().await;
    let all: Vec<String> = others.iter().chain(&targets).cloned().collect();
    let counts = check(store.addr, &all, &[&main, &ledger]).await;
    report("slow / 5xx / reset / hanging upstream", &counts);
    assert!(counts.clean(), "{counts:?}");
    assert!(ledger.acked_count() > 0, "other sessions were not served meanwhile");
    faulty.stop().await;
    healthy.stop().await;
}

/// Writes turn 1 of `s` through `c` with its write-back meeting `rule` at `relay`: answered
/// as applied, and stored (read through `direct`).
async fn write_through_a_cut(
    relay: &Relay,
    rule: OnPut,
    (c, direct): (&turnlock::client::JsonClient, &turnlock::client::JsonClient),
    ledger: &Ledger,
    s: &str,
) {
    relay.on_put(rule);
    let token = format!("{s}-write");
    let reply = try_append(c, s, 1, &token, true, &[]).await.expect("an HTTP answer");
    let landed = message_ids(&get_doc(direct, s).await.json).contains(&token);
    eprintln!("{s}: {} {} (stored: {landed})", reply.status, reply.json);
    assert!(reply.status.is_success(), "{s}: {} {}", reply.status, reply.json);
    assert!(landed, "{s}: acknowledged but not stored");
    record(ledger, &AtomicU64::new(0), s, 1, &token, Ok(reply));
}

/// Fault 5b: A write-back's connection is cut before its answer (a store or load balancer
/// closing a keep-alive connection just as the write-back goes out; or the answer lost after
/// the store applied it). With a store that gives ETags the outcome is resolved under the
/// commit slot (the write-back sent again under the same `If-Match`): the write is answered
/// as applied exactly when it is stored, and the session's next write goes through at once,
/// not after the slot of an unknown outcome has lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_back_cut_before_its_answer_is_resolved_not_left_unknown() {
    let redis = RedisServer::start();
    let store = store().await;
    let relay = Relay::start(store.addr).await;
    let p = proxy(args(&relay.url("http"), &redis.url())).await;
    let (c, direct) = (client(p.addr), client(store.addr));
    let ledger = Ledger::default();
    let cases = [
        ("never-sent", OnPut::ResetOnce, true),
        ("answer-lost", OnPut::LoseAnswerOnce, true),
        // The session's first write: created under `If-None-Match: *`.
        ("create-never-sent", OnPut::ResetOnce, false),
        ("create-answer-lost", OnPut::LoseAnswerOnce, false),
    ];
    let mut sessions = Vec::new();
    for (name, rule, seeded) in cases {
        let s = format!("cut-{name}");
        sessions.push(s.clone());
        if seeded {
            assert!(write_until_acked(&c, &ledger, &s, 1, &format!("{s}-seed")).await);
        }
        write_through_a_cut(&relay, rule, (&c, &direct), &ledger, &s).await;
        // The next write of the session is not held back by the cut one.
        let started = tokio::time::Instant::now();
        let next = try_append(&c, &s, 2, &format!("{s}-next"), true, &[])
            .await
            .expect("an HTTP answer");
        assert!(
            next.status.is_success(),
            "{name}: next write {} {}",
            next.status,
            next.json
        );
        assert!(
            started.elapsed() < lease(),
            "{name}: next write took {:?}",
            started.elapsed()
        );
        record(&ledger, &AtomicU64::new(0), &s, 2, &format!("{s}-next"), Ok(next));
    }
    let counts = check(store.addr, &sessions, &[&ledger]).await;
    report("write-back connection cut before its answer", &counts);
    assert!(counts.clean(), "{counts:?}");
    assert!(
        relay.lost_responses() == 2,
        "the answers were not lost: the fault did not happen"
    );
    assert_no_locks_left(&redis).await;
    p.stop().await;
}

/// Fault 5c: The same cuts at a store that gives no ETags: the write-back is sent once more
/// (the same bytes, under the commit slot) and answered as applied exactly when it is
/// stored. Nothing the store checks would refuse the first copy arriving late, so the
/// session's commit slot is still left to lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_back_cut_at_a_store_without_etags_is_answered_as_stored() {
    let redis = RedisServer::start();
    let store = store_without_etags().await;
    let relay = Relay::start(store.addr).await;
    let p = proxy(args(&relay.url("http"), &redis.url())).await;
    let (c, direct) = (client(p.addr), client(store.addr));
    let ledger = Ledger::default();
    let mut sessions = Vec::new();
    for (name, rule) in [("never-sent", OnPut::ResetOnce), ("answer-lost", OnPut::LoseAnswerOnce)] {
        let s = format!("cut-plain-{name}");
        sessions.push(s.clone());
        assert!(write_until_acked(&c, &ledger, &s, 1, &format!("{s}-seed")).await);
        write_through_a_cut(&relay, rule, (&c, &direct), &ledger, &s).await;
    }
    let counts = check(store.addr, &sessions, &[&ledger]).await;
    report(
        "write-back connection cut before its answer, store without ETags",
        &counts,
    );
    assert!(counts.clean(), "{counts:?}");
    assert!(
        relay.lost_responses() == 1,
        "the answer was not lost: the fault did not happen"
    );
    assert_no_locks_left(&redis).await;
    p.stop().await;
}

/// Fault 7: The agent retries after losing the answer to a write that did land (`Idempotency-Key`):
/// each write is applied exactly once. Messages carry no id, so only the idempotency record
/// can tell a retry from a new write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_retries_with_idempotency_key_apply_once() {
    let redis = RedisServer::start();
    let store = store().await;
    let p = proxy(args(&format!("http://{}", store.addr), &redis.url())).await;
    let relay = Relay::start(p.addr).await;
    relay.lose_every_nth_response(3);
    let agent = turnlock::client::JsonClient::new(relay.url("http"));
    let all = sessions("retry", 4);
    let ledger = std::sync::Arc::new(Ledger::default());
    let replayed = counter();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let (agent, all, ledger, replayed) = (agent.clone(), all.clone(), ledger.clone(), replayed.clone());
        tasks.push(tokio::spawn(async move {
            for n in 0..25 {
                let s = &all[(i + n) % all.len()];
                let token = format!("retry-{i}-{n}");
                let headers = [("idempotency-key", token.clone())];
                let mut outcome = Err("never sent".to_owned());
                for _attempt in 0..30 {
                    outcome = try_append(&agent, s, 1, &token, false, &headers).await;
                    match &outcome {
                        Ok(r) if r.status.is_success() || r.status.is_client_error() => break,
                        _ => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
                if let Ok(r) = &outcome {
                    if r.headers.contains_key("idempotent-replayed") {
                        replayed.fetch_add(1, Ordering::SeqCst);
                    }
                }
                record(&ledger, &AtomicU64::new(0), s, 1, &token, outcome);
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("bounded")
            .expect("task");
    }
    let counts = check(store.addr, &all, &[&ledger]).await;
    report("client retries after a lost answer (Idempotency-Key)", &counts);
    eprintln!(
        "answers lost by the network: {}, retries answered from the record: {}",
        relay.lost_responses(),
        replayed.load(Ordering::SeqCst)
    );
    assert!(
        relay.lost_responses() > 0,
        "no answer was lost: the fault did not happen"
    );
    assert!(
        replayed.load(Ordering::SeqCst) > 0,
        "no retry was answered from its record"
    );
    assert_eq!(counts.acknowledged, 150, "every write is acknowledged in the end");
    assert!(counts.clean(), "{counts:?}");
    p.stop().await;
}

/// A group commit of several writes moves the document by one version, and every answer in
/// the batch names the version the store actually holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_writes_answer_the_version_the_store_holds() {
    let redis = RedisServer::start();
    let store = store().await;
    let p = proxy(args(&format!("http://{}", store.addr), &redis.url())).await;
    let c = client(p.addr);
    let mut tasks = Vec::new();
    for i in 0..24 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            try_append(&c, "batched", 1, &format!("batched-{i}"), true, &[]).await
        }));
    }
    let mut versions = Vec::new();
    for t in tasks {
        let r = t.await.expect("task").expect("answer");
        assert!(r.status.is_success(), "{}", r.json);
        versions.push(r.json["version"].as_u64().expect("version"));
    }
    versions.sort();
    versions.dedup();
    let doc = get_doc(&client(store.addr), "batched").await.json;
    assert_eq!(message_ids(&doc).len(), 24);
    assert_eq!(
        doc["version"].as_u64(),
        versions.last().copied(),
        "answers name versions the store never had: {versions:?}"
    );
    assert_eq!(
        versions,
        (1..=versions.len() as u64).collect::<Vec<_>>(),
        "each commit is one version"
    );
    p.stop().await;
}
