//! The commit order's cost: the grant takes the document's commit slot with the lock, and the
//! release gives both back (with the turn mark and the records), so an uncontended write
//! costs two Redis round trips, the same as a bare lock acquire and release.

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::json;

use crate::support::*;

/// The commands a client sent about session `id` (not those its scripts ran), from
/// `MONITOR` lines.
fn sent_for<'a>(lines: &'a [String], id: &str) -> Vec<&'a str> {
    let tag = format!("{{{id}}}");
    lines
        .iter()
        .filter(|l| !l.contains(" lua] ") && l.contains(&tag))
        .map(String::as_str)
        .collect()
}

/// The lines of the script runs that `sent` started, one run per command (Redis runs a
/// script's commands right after the `EVALSHA` that started it, with nothing in between).
fn runs_after<'a>(lines: &'a [String], sent: &str) -> Vec<&'a str> {
    let start = lines.iter().position(|l| l == sent).map_or(lines.len(), |i| i + 1);
    lines[start..]
        .iter()
        .take_while(|l| l.contains(" lua] "))
        .map(String::as_str)
        .collect()
}

#[tokio::test]
async fn an_uncontended_merge_write_takes_two_redis_round_trips() {
    let redis = RedisServer::start();
    let store = store().await;
    let proxy = proxy(proxy_args(store.addr, Some(&redis))).await;
    let agent = client(proxy.addr);
    // The first write loads the scripts into Redis (`SCRIPT LOAD` on a miss).
    assert_eq!(append_ids(&agent, "warm", 1, &["w"]).await.status, StatusCode::CREATED);

    let monitor = Monitor::start(&redis);
    let r = append_ids(&agent, "rt", 1, &["m1"]).await;
    let lines = monitor.stop(&redis);
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let sent = sent_for(&lines, "rt");
    assert_eq!(sent.len(), 2, "one grant and one release, nothing else: {sent:#?}");
    assert!(sent.iter().all(|l| l.contains("\"EVALSHA\"")), "{sent:#?}");
    let slot_key = |l: &&str| l.contains("turnlock:session:{rt}:") && l.contains(":slot\"");
    let grant = runs_after(&lines, sent[0]);
    assert!(
        grant.iter().any(|l| l.contains("\"SET\"") && slot_key(l)),
        "the grant takes the document's commit slot: {grant:#?}"
    );
    let release = runs_after(&lines, sent[1]);
    assert!(
        release.iter().any(|l| l.contains("\"DEL\"") && slot_key(l)),
        "the release gives the commit slot back: {release:#?}"
    );
    assert!(
        release.iter().any(|l| l.contains(r#""DEL" "turnlock:session:{rt}:1""#)),
        "the release gives the lock back: {release:#?}"
    );
    assert!(redis.keys("turnlock:session:{rt}:*:slot").is_empty(), "no slot left");
    assert!(redis.lock_keys().is_empty(), "no lock left");
    // The commit order holds across writers of other turns: the next turn is written after.
    assert_eq!(append_ids(&agent, "rt", 2, &["m2"]).await.status, StatusCode::OK);
    let ids = message_ids(&get_doc(&client(store.addr), "rt").await.json);
    assert_eq!(ids, ["m1", "m2"]);
    proxy.stop().await;
    store.stop().await;
}

/// A store that accepts every write (`201`), for serialize routes.
async fn accepting_store() -> std::net::SocketAddr {
    serve(|_req: Request<Incoming>| async move {
        Response::builder()
            .status(201)
            .body(Full::new(Bytes::from_static(b"{\"ok\":true}")))
            .expect("response")
    })
    .await
}

fn serialize_args(
    upstream: std::net::SocketAddr,
    redis: Option<&RedisServer>,
    dir: &std::path::Path,
) -> turnlock::config::ProxyArgs {
    let routes = dir.join("routes.toml");
    std::fs::write(
        &routes,
        "[[route]]\nmethod = \"POST\"\npath = \"/threads/{session}/events\"\nturn = { header = \"X-Turn\" }\nmode = \"serialize\"\n",
    )
    .expect("write routes");
    let mut args = proxy_args(upstream, redis);
    args.routes = Some(routes.to_string_lossy().into_owned());
    args
}

#[tokio::test]
async fn a_serialized_write_raises_the_turn_mark_in_the_release_round_trip() {
    let redis = RedisServer::start();
    let upstream = accepting_store().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = proxy(serialize_args(upstream, Some(&redis), dir.path())).await;
    let agent = client(proxy.addr);
    let post = |id: &'static str, turn: u64| {
        let agent = agent.clone();
        async move {
            agent
                .send(
                    Method::POST,
                    &format!("/threads/{id}/events"),
                    Some(&json!({"e": turn})),
                    &[("x-turn", turn.to_string())],
                )
                .await
                .expect("post")
        }
    };
    assert_eq!(post("warm", 1).await.status, StatusCode::CREATED);

    let monitor = Monitor::start(&redis);
    let r = post("sr", 4).await;
    let lines = monitor.stop(&redis);
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    let sent = sent_for(&lines, "sr");
    assert_eq!(sent.len(), 2, "one grant and one release, nothing else: {sent:#?}");
    let release = runs_after(&lines, sent[1]);
    assert!(
        release
            .iter()
            .any(|l| l.contains("\"SET\"") && l.contains(":turn\" \"4\"")),
        "the release raises the turn mark to the accepted turn: {release:#?}"
    );
    assert!(redis.keys("turnlock:session:{sr}:*:slot").is_empty(), "no slot left");
    // The mark raised by the release makes an older turn stale.
    let r = post("sr", 3).await;
    assert_eq!(
        (r.status, r.json["error"].as_str(), r.json["current_turn"].as_u64()),
        (StatusCode::CONFLICT, Some("stale_turn"), Some(4)),
        "{}",
        r.json
    );
    proxy.stop().await;
}

#[tokio::test]
async fn without_redis_a_serialized_write_raises_the_turn_mark_at_its_release() {
    let upstream = accepting_store().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = proxy(serialize_args(upstream, None, dir.path())).await;
    let agent = client(proxy.addr);
    let post = |turn: u64| {
        let agent = agent.clone();
        async move {
            agent
                .send(
                    Method::POST,
                    "/threads/mem/events",
                    Some(&json!({"e": turn})),
                    &[("x-turn", turn.to_string())],
                )
                .await
                .expect("post")
        }
    };
    assert_eq!(post(4).await.status, StatusCode::CREATED);
    assert_eq!(post(4).await.status, StatusCode::CREATED, "the slot was given back");
    let r = post(3).await;
    assert_eq!(
        (r.status, r.json["error"].as_str(), r.json["current_turn"].as_u64()),
        (StatusCode::CONFLICT, Some("stale_turn"), Some(4)),
        "{}",
        r.json
    );
    assert_eq!(post(5).await.status, StatusCode::CREATED);
    proxy.stop().await;
}
