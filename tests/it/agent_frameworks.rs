//! Real agent frameworks' session stores through turnlock: Strands Agents (`strands-agents`
//! from PyPI) keeping a session in S3 with `S3SessionManager`, one object per message, with a
//! stand-in model class (no model provider, no network), against moto's S3 server.
//!
//! Two replicas of a stateless service (a fresh `Agent` per request) serve one session, one
//! request each at once, for several rounds (`tests/it/scripts/strands_replicas.py`).

use serde_json::Value;

use crate::support::third_party::{moto_server, run_python, Server};
use crate::support::{proxy, proxy_args, RedisServer};

/// The shipped routes file, used as a user uses it (its bucket is `agent-sessions`, its
/// prefix `strands`).
const STRANDS_ROUTES: &str = include_str!("../../deploy/routes/strands-s3.toml");
const BUCKET: &str = "agent-sessions";
const ROUNDS: usize = 5;

fn aws_env() {
    std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
}

/// One sidecar per replica in front of `store`, sharing `redis`, serving `routes`.
async fn sidecars(
    store: &Server,
    redis: &RedisServer,
    routes: &tempfile::NamedTempFile,
    n: usize,
) -> Vec<turnlock::sidecar::Running> {
    let mut out = Vec::new();
    for _ in 0..n {
        let mut args = proxy_args(format!("127.0.0.1:{}", store.port).parse().expect("addr"), Some(redis));
        args.routes = Some(routes.path().display().to_string());
        out.push(proxy(args).await);
    }
    out
}

fn routes_file(text: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), text).expect("write routes");
    file
}

async fn python(args: Vec<String>) -> Value {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_python("strands_replicas.py", &args)
    })
    .await
    .expect("python")
}

async fn race(endpoints: &[String], session: &str, store: &Server) -> Value {
    python(vec![
        "race".into(),
        endpoints.join(","),
        BUCKET.into(),
        session.into(),
        ROUNDS.to_string(),
        store.url(),
    ])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strands_replicas_straight_to_s3_lose_messages_silently() {
    aws_env();
    let moto = moto_server();
    let run = race(&[moto.url(), moto.url()], "direct", &moto).await;
    eprintln!("straight to the store: {run}");
    assert_eq!(run["failed"], serde_json::json!([]), "no request raised: {run}");
    assert!(
        run["replaced"].as_array().is_some_and(|r| !r.is_empty()),
        "no stored message was replaced by another request's: the negative control proves nothing: {run}"
    );
    assert!(
        run["lost"].as_array().is_some_and(|l| !l.is_empty()),
        "no request that returned normally lost a message: {run}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strands_replicas_through_sidecars_lose_no_message_and_the_loser_fails_at_once() {
    aws_env();
    let moto = moto_server();
    let redis = RedisServer::start();
    let routes = routes_file(STRANDS_ROUTES);
    let proxies = sidecars(&moto, &redis, &routes, 2).await;
    let endpoints: Vec<String> = proxies.iter().map(|p| format!("http://{}", p.addr)).collect();
    let run = race(&endpoints, "through", &moto).await;
    eprintln!("through the sidecars: {run}");
    // Every request that returned normally has all its messages stored.
    assert_eq!(run["lost"], serde_json::json!([]), "{run}");
    // No acknowledged message object holds another request's message.
    assert_eq!(run["replaced"], serde_json::json!([]), "{run}");
    let failed = run["failed"].as_array().cloned().unwrap_or_default();
    // The replicas raced (each round both read the same session): the losers were refused.
    assert!(
        !failed.is_empty(),
        "no request lost a race: the test proves nothing: {run}"
    );
    for f in &failed {
        // Refused in S3's terms, which botocore raises without retrying, at once.
        assert_eq!(f["code"], "PreconditionFailed", "{f}");
        assert_eq!(f["status"], 412, "{f}");
        assert_eq!(f["attempts"], 0, "botocore retried: {f}");
        assert!(
            f["seconds"].as_f64().is_some_and(|s| s < 5.0),
            "the losing request hung: {f}"
        );
    }
    // Each round, one request per replica; the first and the last request are alone.
    assert_eq!(run["requests"], 2 * ROUNDS + 2, "{run}");
    assert_eq!(
        run["ok"].as_u64().unwrap_or(0) as usize + failed.len(),
        2 * ROUNDS + 2,
        "{run}"
    );
    // The next request on the session succeeds.
    assert_eq!(run["after_ok"], true, "{run}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strands_redaction_of_the_latest_message_goes_through_the_sidecar() {
    aws_env();
    let moto = moto_server();
    let redis = RedisServer::start();
    let routes = routes_file(STRANDS_ROUTES);
    let proxies = sidecars(&moto, &redis, &routes, 1).await;
    let endpoint = format!("http://{}", proxies[0].addr);
    let out = python(vec![
        "redact".into(),
        endpoint,
        BUCKET.into(),
        "redacted".into(),
        moto.url(),
    ])
    .await;
    assert_eq!(out["redacted"], true, "{out}");
    assert_eq!(out["stored_redact"]["content"][0]["text"], "[redacted]", "{out}");
    // The original stays beside it, as the framework keeps it; a fresh agent sees the redaction.
    assert_eq!(out["stored_message"], "answer to my card is 4111", "{out}");
    assert_eq!(out["seen"], "[redacted]", "{out}");
}
