//! Real stores at their edges: writers beside the sidecar on documents turnlock never wrote,
//! `If-None-Match: *`, requests on a write route that are not writes of the document (S3
//! subresources and copies, CouchDB's `_security`), and the store's own refusals — against
//! moto's S3 server with boto3 and `pouchdb-server`.

use http::Method;
use serde_json::{json, Value};
use turnlock::client::JsonClient;

use crate::support::third_party::{
    moto_server, pouchdb_server, routes_file, run_python, sidecars, Server, COUCHDB_ROUTES, S3_ROUTES,
};
use crate::support::{proxy, proxy_args, RedisServer};

/// One sidecar in front of `store`.
async fn sidecar(store: &Server, redis: &RedisServer, routes: &tempfile::NamedTempFile) -> turnlock::sidecar::Running {
    sidecars(store, redis, routes, 1).await.remove(0)
}

/// Runs one case of `s3_edges.py` through a sidecar in front of a fresh moto server.
async fn s3_case(case: &'static str) -> Value {
    let moto = moto_server();
    let redis = RedisServer::start();
    let routes = routes_file(S3_ROUTES);
    let p = sidecar(&moto, &redis, &routes).await;
    let args = [
        case.to_owned(),
        format!("http://{}", p.addr),
        moto.url(),
        format!("edges-{}", case.replace('_', "-")),
    ];
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_python("s3_edges.py", &args)
    })
    .await
    .expect("python")
}

fn ids(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_careful_writer_beside_the_sidecar_keeps_its_write_on_objects_turnlock_never_wrote() {
    let r = s3_case("beside").await;
    // Absent when the agent read: the careful writer's create and the agent's copy both stay.
    assert_eq!(r["absent_read"]["code"], "NoSuchKey", "{r}");
    assert_eq!(r["absent_direct"]["ok"], true, "{r}");
    assert_eq!(r["absent_agent"]["ok"], true, "{r}");
    assert_eq!(ids(&r["absent_ids"]), ["direct", "mine"], "{r}");
    // A legacy object, changed straight at the store after the agent's read: its copy with
    // no precondition, or with the object's current ETag, loses nothing of the other write
    // (the agent's values for the fields it sent).
    for case in ["legacy", "legacy_fresh_tag"] {
        assert_eq!(r[format!("{case}_direct")]["ok"], true, "{case}: {r}");
        assert_eq!(r[format!("{case}_agent")]["ok"], true, "{case}: {r}");
        assert_eq!(r[format!("{case}_agent")]["attempts"], 1, "{case}: {r}");
        assert_eq!(ids(&r[format!("{case}_ids")]), ["old", "direct", "mine"], "{case}: {r}");
        assert_eq!(r[format!("{case}_title")], "mine", "{case}: {r}");
    }
    // With the ETag it read (now stale): refused as S3 refuses it, nothing written.
    assert_eq!(r["legacy_stale_tag_agent"]["status"], 412, "{r}");
    assert_eq!(r["legacy_stale_tag_agent"]["code"], "PreconditionFailed", "{r}");
    assert_eq!(ids(&r["legacy_stale_tag_ids"]), ["old", "direct"], "{r}");
    // Once turnlock wrote the object, a copy read through the sidecar names its base: what it
    // leaves out is deleted.
    assert_eq!(r["known_base_agent"]["ok"], true, "{r}");
    assert_eq!(ids(&r["known_base_ids"]), ["direct", "mine"], "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_if_none_match_star_on_an_existing_object_is_refused_as_s3_refuses_it() {
    let r = s3_case("if_none_match").await;
    assert_eq!(r["existing"]["status"], 412, "{r}");
    assert_eq!(r["existing"]["code"], "PreconditionFailed", "{r}");
    assert_eq!(r["existing"]["attempts"], 1, "{r}");
    assert_eq!(ids(&r["existing_ids"]), ["first"], "{r}");
    assert_eq!(r["new"]["ok"], true, "{r}");
    assert_eq!(r["new_again"]["status"], 412, "{r}");
    assert_eq!(ids(&r["new_ids"]), ["a"], "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_subresources_copies_and_multipart_uploads_pass_through_untouched() {
    let r = s3_case("subresources").await;
    assert_eq!(r["put"]["ok"], true, "{r}");
    assert_eq!(r["tagging"]["ok"], true, "{r}");
    assert_eq!(r["tags"], json!([{"Key": "t", "Value": "v"}]), "{r}");
    assert_eq!(r["acl"]["ok"], true, "{r}");
    assert_eq!(r["copy"]["ok"], true, "{r}");
    assert_eq!(r["after_copy"], json!({"messages": [{"id": "fromcopy"}]}), "{r}");
    // A part is a part, not the object.
    assert_eq!(r["part"]["ok"], true, "{r}");
    assert_eq!(r["during_upload"], json!({"messages": [{"id": "orig"}]}), "{r}");
    assert_eq!(r["complete"]["ok"], true, "{r}");
    assert_eq!(r["after_upload"], json!({"messages": [{"id": "part"}]}), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_the_stores_refusals_are_its_own_answers_and_an_unreadable_object_is_not_retried() {
    let r = s3_case("errors").await;
    assert_eq!(r["no_bucket_direct"]["code"], "NoSuchBucket", "{r}");
    assert_eq!(r["no_bucket"]["status"], 404, "{r}");
    assert_eq!(r["no_bucket"]["code"], "NoSuchBucket", "{r}");
    assert_eq!(r["no_bucket"]["attempts"], 1, "{r}");
    assert_eq!(r["not_json"]["status"], 409, "{r}");
    assert_eq!(r["not_json"]["code"], "InvalidDocument", "{r}");
    assert_eq!(r["not_json"]["attempts"], 1, "{r}");
}

/// A sidecar with `routes` in front of a fresh pouchdb-server holding an empty `db`, and
/// clients straight to the store and through the sidecar.
struct Couch {
    direct: JsonClient,
    agent: JsonClient,
    sidecar: turnlock::sidecar::Running,
    _routes: tempfile::NamedTempFile,
    _redis: RedisServer,
    store: Server,
}

async fn couch(routes: &str) -> Couch {
    let store = pouchdb_server();
    let redis = RedisServer::start();
    let routes = routes_file(routes);
    let sidecar = sidecar(&store, &redis, &routes).await;
    let direct = JsonClient::new(store.url());
    let agent = JsonClient::new(format!("http://{}", sidecar.addr));
    let r = direct.send(Method::PUT, "/db", None, &[]).await.expect("create db");
    assert!(r.status.is_success(), "{}", r.status);
    Couch {
        direct,
        agent,
        sidecar,
        _routes: routes,
        _redis: redis,
        store,
    }
}

/// The couchdb routes with a delete route for documents.
fn couchdb_with_delete() -> String {
    format!("{COUCHDB_ROUTES}\n[[route]]\nmethod = \"DELETE\"\npath = \"/{{db}}/{{session}}\"\nmode = \"merge\"\nkind = \"delete\"\n")
}

/// `doc` written to `/db/d` through the sidecar; the `_rev` the store gave it.
async fn written_rev(agent: &JsonClient, direct: &JsonClient, doc: &Value) -> String {
    let r = agent.send(Method::PUT, "/db/d", Some(doc), &[]).await.expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let stored = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    stored["_rev"].as_str().expect("a _rev").to_owned()
}

fn message_ids(doc: &Value) -> Vec<String> {
    doc["messages"]
        .as_array()
        .map(|m| m.iter().filter_map(|m| m["id"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_copy_without_a_turnlock_version_is_merged_without_deletions() {
    let Couch { direct, agent, .. } = &couch(COUCHDB_ROUTES).await;

    // Absent when the agent read; created straight at the store; the agent's copy (no `_rev`,
    // which CouchDB itself would refuse 409) keeps the other write.
    let r = agent.send(Method::GET, "/db/a", None, &[]).await.expect("read");
    assert_eq!(r.status, 404);
    let r = direct
        .send(
            Method::PUT,
            "/db/a",
            Some(&json!({"messages": [{"id": "direct"}]})),
            &[],
        )
        .await
        .expect("direct");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let mine = json!({"_id": "a", "messages": [{"id": "mine"}]});
    let r = agent.send(Method::PUT, "/db/a", Some(&mine), &[]).await.expect("agent");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let doc = direct.send(Method::GET, "/db/a", None, &[]).await.expect("read").json;
    assert_eq!(message_ids(&doc), ["direct", "mine"], "{doc}");

    // "On 409 take the latest `_rev` and PUT my copy again": a copy read as absent, with the
    // latest `_rev` in its body or in `If-Match`, is written (no 409 forever), and deletes
    // nothing another writer stored.
    for (n, in_header) in [(1, false), (2, true)] {
        let mut copy = json!({"_id": "a", "messages": [{"id": format!("late-{n}")}]});
        let latest = direct.send(Method::GET, "/db/a", None, &[]).await.expect("read").json;
        let rev = latest["_rev"].as_str().expect("a _rev").to_owned();
        let headers = if in_header {
            vec![("if-match", format!("\"{rev}\""))]
        } else {
            copy["_rev"] = json!(rev);
            vec![]
        };
        let r = agent
            .send(Method::PUT, "/db/a", Some(&copy), &headers)
            .await
            .expect("agent");
        assert_eq!(r.status, 201, "copy {n}: {:?}", r.json);
    }
    let doc = direct.send(Method::GET, "/db/a", None, &[]).await.expect("read").json;
    assert_eq!(message_ids(&doc), ["direct", "mine", "late-1", "late-2"], "{doc}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_database_resources_pass_through_untouched() {
    let Couch { direct, agent, .. } = &couch(COUCHDB_ROUTES).await;
    let security = json!({"admins": {"names": ["ops"], "roles": []}, "members": {"names": [], "roles": []}});
    let through = agent
        .send(Method::PUT, "/db/_security", Some(&security), &[])
        .await
        .expect("security through the sidecar");
    let straight = direct
        .send(Method::PUT, "/db/_security", Some(&security), &[])
        .await
        .expect("security straight");
    assert_eq!(
        (through.status, &through.json),
        (straight.status, &straight.json),
        "the store's own answer"
    );
    let stored = direct
        .send(Method::GET, "/db/_security", None, &[])
        .await
        .expect("read")
        .json;
    assert_eq!(stored, security, "stored as sent, no turnlock field");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_careful_writers_beside_sidecars_on_new_documents_lose_nothing() {
    let couch = pouchdb_server();
    let redis = RedisServer::start();
    let routes = routes_file(COUCHDB_ROUTES);
    let mut proxies = Vec::new();
    for _ in 0..3 {
        proxies.push(sidecar(&couch, &redis, &routes).await);
    }
    let direct = JsonClient::new(couch.url());
    let r = direct.send(Method::PUT, "/db", None, &[]).await.expect("create db");
    assert!(r.status.is_success(), "{}", r.status);
    let endpoints: Vec<String> = proxies.iter().map(|p| format!("http://{}", p.addr)).collect();
    // 6 agents through the sidecars ("take the latest _rev" on 409), 3 careful ones straight
    // to the store, 6 writes each, on 4 documents that do not exist yet.
    let args = [
        endpoints.join(","),
        couch.url(),
        "db".to_owned(),
        "4".to_owned(),
        "6".to_owned(),
        "3".to_owned(),
        "6".to_owned(),
    ];
    let run = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_python("couch_absent.py", &args)
    })
    .await
    .expect("python");
    assert_eq!(run["lost"], json!([]), "acknowledged writes lost: {run}");
    assert_eq!(run["dup"], json!([]), "{run}");
    assert_eq!(run["error_count"], 0, "{run}");
    assert_eq!(run["acked"], run["writes"], "{run}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_copies_that_differ_only_in_their_rev_are_no_conflict() {
    let couch = pouchdb_server();
    let redis = RedisServer::start();
    let routes = routes_file(COUCHDB_ROUTES);
    let p = sidecar(&couch, &redis, &routes).await;
    let direct = JsonClient::new(couch.url());
    let r = direct.send(Method::PUT, "/db", None, &[]).await.expect("create db");
    assert!(r.status.is_success(), "{}", r.status);
    // 12 agents on one document through one sidecar: their PUTs are merged in batches, each
    // copy carrying the `_rev` it read (or took after a 409).
    let args = [
        format!("http://{}", p.addr),
        couch.url(),
        "db".to_owned(),
        "1".to_owned(),
        "12".to_owned(),
        "0".to_owned(),
        "6".to_owned(),
    ];
    let run = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_python("couch_absent.py", &args)
    })
    .await
    .expect("python");
    assert_eq!(run["lost"], json!([]), "{run}");
    assert_eq!(run["acked"], run["writes"], "{run}");
    assert_eq!(run["turnlock_conflict_count"], 0, "{run}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn if_none_match_star_on_an_existing_document_is_refused_in_every_dialect() {
    // turnlock's own API in front of the stand-in store.
    let store = crate::support::store().await;
    let p = proxy(proxy_args(store.addr, None)).await;
    let agent = crate::support::client(p.addr);
    let create = json!({"turn": 1, "messages": [{"id": "a"}]});
    let star = [("if-none-match", "*".to_owned())];
    let r = agent
        .send(Method::PUT, "/v1/sessions/inm", Some(&create), &star)
        .await
        .expect("create");
    assert!(r.status.is_success(), "{} {}", r.status, r.json);
    let again = json!({"turn": 1, "messages": [{"id": "b"}]});
    let r = agent
        .send(Method::PUT, "/v1/sessions/inm", Some(&again), &star)
        .await
        .expect("again");
    assert_eq!(
        (r.status.as_u16(), r.json["error"].as_str()),
        (412, Some("version_mismatch")),
        "{}",
        r.json
    );
    let message = r.json["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("exists") && message.contains("If-None-Match"),
        "{message}"
    );

    // CouchDB: 409 conflict, as CouchDB refuses a create over a document.
    let couch = pouchdb_server();
    let redis = RedisServer::start();
    let routes = routes_file(COUCHDB_ROUTES);
    let p = sidecar(&couch, &redis, &routes).await;
    let direct = JsonClient::new(couch.url());
    let agent = JsonClient::new(format!("http://{}", p.addr));
    direct.send(Method::PUT, "/db", None, &[]).await.expect("create db");
    let r = direct
        .send(Method::PUT, "/db/x", Some(&json!({"messages": [{"id": "first"}]})), &[])
        .await
        .expect("seed");
    assert_eq!(r.status, 201);
    let r = agent
        .send(
            Method::PUT,
            "/db/x",
            Some(&json!({"messages": [{"id": "second"}]})),
            &star,
        )
        .await
        .expect("put");
    assert_eq!(
        (r.status.as_u16(), r.json["error"].as_str()),
        (409, Some("conflict")),
        "{}",
        r.json
    );
    let doc = direct.send(Method::GET, "/db/x", None, &[]).await.expect("read").json;
    assert_eq!(message_ids(&doc), ["first"], "{doc}");
}

/// CouchDB deletes a document at the revision the client names with `?rev=` (as PouchDB and
/// nano send it), and refuses (409) when that revision is no longer the latest: a session
/// delete through the sidecar passes the agent's query string on, so a delete based on an old
/// revision deletes nothing, and the agent gets CouchDB's own answer (its new `rev`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_session_delete_at_an_old_rev_is_refused_and_at_the_latest_deletes() {
    let Couch { direct, agent, .. } = &couch(&couchdb_with_delete()).await;
    let rev = || async {
        let doc = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
        doc["_rev"].as_str().expect("a _rev").to_owned()
    };
    let first = json!({"_id": "d", "turn": 1, "messages": [{"id": "one"}]});
    let r = agent
        .send(Method::PUT, "/db/d", Some(&first), &[])
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let old = rev().await;
    let second = json!({"_id": "d", "turn": 2, "messages": [{"id": "two"}]});
    let r = agent
        .send(Method::PUT, "/db/d", Some(&second), &[])
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let latest = rev().await;

    let r = agent
        .send(Method::DELETE, &format!("/db/d?rev={old}"), None, &[])
        .await
        .expect("delete");
    assert_eq!(r.status, 409, "a delete at an old revision: {:?}", r.json);
    assert_eq!(r.json["error"], json!("conflict"), "CouchDB's own answer: {:?}", r.json);
    let doc = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    assert_eq!(message_ids(&doc), ["one", "two"], "nothing deleted: {doc}");

    let r = agent
        .send(Method::DELETE, &format!("/db/d?rev={latest}"), None, &[])
        .await
        .expect("delete");
    assert_eq!(r.status, 200, "{:?}", r.json);
    assert_eq!(r.json["ok"], json!(true), "{:?}", r.json);
    let gone = r.json["rev"].as_str().unwrap_or_default();
    assert!(
        gone.starts_with("3-"),
        "CouchDB's own revision of the deletion: {:?}",
        r.json
    );
    let r = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read");
    assert_eq!(r.status, 404, "deleted at the store: {:?}", r.json);

    let next = json!({"_id": "d", "turn": 1, "messages": [{"id": "next-life"}]});
    let r = agent.send(Method::PUT, "/db/d", Some(&next), &[]).await.expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let doc = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    assert_eq!(message_ids(&doc), ["next-life"], "{doc}");
}

/// CouchDB servers disagree on a path with an empty segment: Apache CouchDB reads `/db/d/`,
/// `/db//d` and `//db/d` as the document `d`, pouchdb-server as an attachment of `d` or the
/// document `/d`. A write or delete so spelled is refused (400 `ambiguous_path`, in CouchDB's
/// form), never forwarded unlocked nor made the delete of `d`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_path_with_an_empty_segment_is_refused() {
    let Couch { direct, agent, .. } = &couch(&couchdb_with_delete()).await;
    let rev = written_rev(
        agent,
        direct,
        &json!({"_id": "d", "turn": 1, "messages": [{"id": "one"}]}),
    )
    .await;

    for path in ["/db/d/", "/db//d", "//db/d"] {
        let url = format!("{path}?rev={rev}");
        let through = agent.send(Method::DELETE, &url, None, &[]).await.expect("delete");
        assert_eq!(through.status, 400, "DELETE {url}: {:?}", through.json);
        assert_eq!(
            through.json["turnlock_error"],
            json!("ambiguous_path"),
            "{:?}",
            through.json
        );
        let other = json!({"_rev": rev, "turn": 1, "messages": [{"id": "other"}]});
        let through = agent.send(Method::PUT, path, Some(&other), &[]).await.expect("write");
        assert_eq!(through.status, 400, "PUT {path}: {:?}", through.json);
        let kept = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read");
        assert_eq!(kept.status, 200, "{path}: {:?}", kept.json);
        assert_eq!(message_ids(&kept.json), ["one"], "{path}: {}", kept.json);
    }
}

/// pouchdb-server serves `/_node/node1@127.0.0.1/db/d` as `/db/d`, and `/db%3A/d` as `/db/d`
/// (it drops from a database name what a file name cannot hold): refused, never written past
/// the document's lock or its turn mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_path_the_store_serves_as_a_sessions_is_refused() {
    let Couch { direct, agent, .. } = &couch(&couchdb_with_delete()).await;
    let rev = written_rev(
        agent,
        direct,
        &json!({"_id": "d", "turn": 5, "messages": [{"id": "five"}]}),
    )
    .await;
    let long = format!("/{}/d", "d".repeat(300));
    // Where pouchdb-server keeps the document `/con/d` (a name Windows reserves): refused,
    // as a name starting with `_` would otherwise go to the store as a system database's.
    let r = direct.send(Method::PUT, "/con", None, &[]).await.expect("create db");
    assert!(r.status.is_success(), "{:?}", r.json);
    let r = agent
        .send(
            Method::PUT,
            "/con/d",
            Some(&json!({"turn": 1, "messages": [{"id": "c"}]})),
            &[],
        )
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    for path in ["/db%3A/d", "/%22db%22/d", "/db%2F/d", "/__con__/d", &long] {
        let older = json!({"_rev": rev, "turn": 3, "messages": [{"id": "three"}]});
        let r = agent.send(Method::PUT, path, Some(&older), &[]).await.expect("write");
        assert_eq!(r.status, 400, "PUT {path}: {:?}", r.json);
        assert_eq!(r.json["turnlock_error"], json!("ambiguous_path"), "{:?}", r.json);
        let r = agent
            .send(Method::DELETE, &format!("{path}?rev={rev}"), None, &[])
            .await
            .expect("delete");
        assert_eq!(r.status, 400, "DELETE {path}: {:?}", r.json);
        let kept = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
        assert_eq!(kept["turn"], json!(5), "{path}: {kept}");
        assert_eq!(message_ids(&kept), ["five"], "{path}: {kept}");
    }
}

/// CouchDB answers 404 to a delete naming a revision it does not have, the document still
/// there: a serialize route's turn mark stays, and an older turn is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_delete_refused_with_404_leaves_older_turns_refused() {
    let Couch { direct, agent, .. } = &couch(
        "[store]\ndialect = \"couchdb\"\n\
         [[route]]\nmethod = \"PUT\"\npath = \"/{db}/{session}\"\nmode = \"serialize\"\nturn = { header = \"X-Turn\" }\n\
         [[route]]\nmethod = \"DELETE\"\npath = \"/{db}/{session}\"\nmode = \"merge\"\nkind = \"delete\"\n",
    ).await;
    let turn = |t: u64| [("x-turn", t.to_string())];
    let r = agent
        .send(Method::PUT, "/db/d", Some(&json!({"turn": 5})), &turn(5))
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let r = agent
        .send(Method::DELETE, "/db/d?rev=9-doesnotexist", None, &[])
        .await
        .expect("delete");
    assert_eq!(r.status, 404, "pouchdb's answer to an unknown rev: {:?}", r.json);
    let r = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read");
    assert_eq!(r.status, 200, "the document is still there");
    let rev = r.json["_rev"].as_str().expect("a _rev").to_owned();
    let stale = json!({"_rev": rev, "turn": 2});
    let r = agent
        .send(Method::PUT, "/db/d", Some(&stale), &turn(2))
        .await
        .expect("write");
    assert_eq!(r.status, 409, "turn 2 after turn 5: {:?}", r.json);
    let r = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read");
    assert_eq!(r.json["turn"], json!(5), "{:?}", r.json);

    // Deleted for real: the next life starts at any turn.
    let r = agent
        .send(Method::DELETE, &format!("/db/d?rev={rev}"), None, &[])
        .await
        .expect("delete");
    assert_eq!(r.status, 200, "{:?}", r.json);
    let r = agent
        .send(Method::PUT, "/db/d", Some(&json!({"turn": 1})), &turn(1))
        .await
        .expect("write");
    assert_eq!(r.status, 201, "the next life: {:?}", r.json);
}

/// A merged write's answer names the document as CouchDB does: its id decoded from the path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_merged_write_answers_with_the_documents_own_id() {
    let Couch { direct, agent, .. } = &couch(COUCHDB_ROUTES).await;
    let doc = json!({"turn": 1, "messages": [{"id": "one"}]});
    let r = agent
        .send(Method::PUT, "/db/a%20b%C3%A9", Some(&doc), &[])
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let stored = direct
        .send(Method::GET, "/db/a%20b%C3%A9", None, &[])
        .await
        .expect("read")
        .json;
    assert_eq!(stored["_id"], json!("a bé"), "{stored}");
    assert_eq!(r.json["id"], stored["_id"], "{:?}", r.json);
    assert_eq!(r.json["rev"], stored["_rev"], "{:?}", r.json);
}

/// S3 keys are literal: `sessions//k.json`, `sessions/k.json/` and `sessions/./k.json` are
/// other objects than `sessions/k.json`, written as sent (never merged into the session's);
/// `//bucket/sessions/k.json`, or the object's path with a parameter S3 ignores, is the
/// session's object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_keys_that_differ_from_a_sessions_by_a_segment_are_other_objects() {
    let r = s3_case("spellings").await;
    assert_eq!(r["session"]["ok"], true, "{r}");
    for name in ["double", "trailing", "dot"] {
        assert_eq!(r[name]["ok"], true, "{name}: {r}");
        assert_eq!(r[format!("{name}_stored")], json!({"other": name}), "{name}: {r}");
    }
    // `//bucket/key` is the session's object: merged into it under the lock.
    assert_eq!(r["leading_slashes"]["status"], 200, "{r}");
    let session = &r["session_stored"];
    assert_eq!(r["ignored_query"]["status"], 200, "{r}");
    assert_eq!(
        message_ids(session),
        ["keep", "slashes", "query"],
        "the session's object: {r}"
    );
    assert!(session.get("other").is_none(), "the session's object: {r}");
}

/// A system database (`_users`, `_replicator`) holds no session: a write of one of its
/// documents on a route's path is forwarded untouched, not merged as a session's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_system_database_document_is_forwarded_untouched() {
    let Couch { direct, agent, .. } = &couch(COUCHDB_ROUTES).await;
    for path in ["/_users/org.couchdb.user:jan", "/%5Fusers/org.couchdb.user:ann"] {
        let name = path.rsplit(':').next().expect("a name");
        let user = json!({"name": name, "type": "user", "roles": [], "password": "pw"});
        let r = agent.send(Method::PUT, path, Some(&user), &[]).await.expect("write");
        assert!(r.status.is_success(), "{path}: {} {:?}", r.status, r.json);
        let stored = direct.send(Method::GET, path, None, &[]).await.expect("read");
        assert_eq!(stored.json["name"], json!(name), "{path}: {:?}", stored.json);
        for field in ["session", "turn", "version", "messages", "life"] {
            assert!(stored.json.get(field).is_none(), "{path}: {field} in {:?}", stored.json);
        }
    }
}

/// S3 and its emulators store `PUT ?versionId=x`, `?uploads`, an `?uploadId` without its
/// part number, … as a plain PutObject: locked as one, an older turn so sent is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_an_older_turn_with_a_parameter_the_store_ignores_is_refused() {
    let r = s3_case("stale_queries").await;
    assert_eq!(r["newer"]["ok"], true, "{r}");
    let older: Vec<_> = r
        .as_object()
        .expect("an object")
        .iter()
        .filter(|(k, _)| k.starts_with("older?"))
        .collect();
    assert_eq!(older.len(), 10, "{r}");
    for (query, answer) in older {
        assert_eq!(answer["status"], 412, "{query}: {r}");
    }
    assert_eq!(r["stored"]["turn"], 2, "{r}");
    assert_eq!(message_ids(&r["stored"]), ["newer"], "{r}");
}

/// Writes turn 5 to a document through a serialize route spelled `first`, then turn 1 (with
/// the document's current `_rev`) spelled `second`: refused, as both name one document.
async fn an_older_turn_spelled_otherwise_is_refused(first: &str, second: &str) {
    let Couch { direct, agent, .. } = &couch(
        "[store]\ndialect = \"couchdb\"\n\
         [[route]]\nmethod = \"PUT\"\npath = \"/{db}/{session}\"\nmode = \"serialize\"\nturn = { header = \"X-Turn\" }\n",
    )
    .await;
    let turn = |t: u64| [("x-turn", t.to_string())];
    let r = agent
        .send(Method::PUT, first, Some(&json!({"turn": 5})), &turn(5))
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let stored = direct.send(Method::GET, second, None, &[]).await.expect("read");
    assert_eq!(stored.json["turn"], json!(5), "one document: {:?}", stored.json);
    let rev = stored.json["_rev"].as_str().expect("a _rev").to_owned();
    let r = agent
        .send(Method::PUT, second, Some(&json!({"_rev": rev, "turn": 1})), &turn(1))
        .await
        .expect("write");
    assert_eq!(r.status, 409, "turn 1 after turn 5, spelled {second}: {:?}", r.json);
    let stored = direct.send(Method::GET, first, None, &[]).await.expect("read");
    assert_eq!(stored.json["turn"], json!(5), "{:?}", stored.json);
}

/// CouchDB reads `/db/a%2A` and `/db/a*` as one document: both spellings share its lock and
/// turn mark, so an older turn is refused whichever spelling it comes in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_two_spellings_of_one_document_share_its_turn_mark() {
    an_older_turn_spelled_otherwise_is_refused("/db/a%2A", "/db/a*").await;
}

/// `%2F` in an id, in either case, is one document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_an_id_holding_a_slash_has_one_turn_mark_however_spelled() {
    an_older_turn_spelled_otherwise_is_refused("/db/%2Fd", "/db/%2fd").await;
}

/// CouchDB serves a `POST` with `X-HTTP-Method-Override: PUT` as the `PUT`: on a document a
/// write route names, refused (400 `method_override`), never forwarded unlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_method_override_that_would_make_a_write_is_refused() {
    let Couch { agent, .. } = &couch(COUCHDB_ROUTES).await;
    let doc = json!({"turn": 1, "messages": [{"id": "one"}]});
    let r = agent.send(Method::PUT, "/db/d", Some(&doc), &[]).await.expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    for header in ["X-HTTP-Method-Override", "x-http-method", "X-Method-Override"] {
        let r = agent
            .send(
                Method::POST,
                "/db/d",
                Some(&json!({"turn": 1})),
                &[(header, "put".into())],
            )
            .await
            .expect("post");
        assert_eq!(r.status, 400, "{header}: {:?}", r.json);
        assert_eq!(r.json["turnlock_error"], json!("method_override"), "{:?}", r.json);
    }
    // A second line, or a list, is read whole: a store may obey any of its items.
    for overrides in [
        &[("x-http-method-override", "GET"), ("x-http-method-override", "PUT")][..],
        &[("x-http-method-override", "PUT, GET")],
        &[("x-method-override", "GET,put")],
    ] {
        let headers: Vec<_> = overrides.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        let r = agent
            .send(Method::POST, "/db/d", Some(&json!({"turn": 1})), &headers)
            .await
            .expect("post");
        assert_eq!(
            r.json["turnlock_error"],
            json!("method_override"),
            "{overrides:?}: {:?}",
            r.json
        );
    }
    // An override naming the request's own method, or a path no route names, is forwarded.
    let r = agent
        .send(
            Method::PUT,
            "/db/d",
            Some(&doc),
            &[("x-http-method-override", "PUT".into())],
        )
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let r = agent
        .send(
            Method::POST,
            "/db",
            Some(&json!({"_id": "e"})),
            &[("x-http-method-override", "PUT".into())],
        )
        .await
        .expect("post");
    assert_ne!(r.json["turnlock_error"], json!("method_override"), "{:?}", r.json);
}

/// CouchDB's `POST /{db}` with an `_id` (nano's `db.insert(doc)`) writes that document as its
/// `PUT` does: through the sidecar it is the write route's locked write, turn rule and all.
/// A `POST` naming no session document (no `_id`, a design document) is the store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_post_naming_a_session_document_is_its_locked_write() {
    let Couch {
        direct, agent, sidecar, ..
    } = &couch(COUCHDB_ROUTES).await;
    let post = |path: &'static str, doc: Value| async move {
        agent.send(Method::POST, path, Some(&doc), &[]).await.expect("post")
    };
    let r = post("/db", json!({"_id": "d", "turn": 2, "messages": [{"id": "two"}]})).await;
    assert_eq!(r.status, 201, "{:?}", r.json);
    assert_eq!(
        (&r.json["ok"], &r.json["id"]),
        (&json!(true), &json!("d")),
        "{:?}",
        r.json
    );
    // An older turn is refused as the PUT's would be: nothing written.
    let r = post("/db", json!({"_id": "d", "turn": 1, "messages": [{"id": "one"}]})).await;
    assert_eq!(r.status, 409, "{:?}", r.json);
    assert_eq!(r.json["turnlock_error"], json!("stale_turn"), "{:?}", r.json);
    // Without a `_rev`, merged (CouchDB itself would answer 409 and write nothing).
    let r = post("/db/", json!({"_id": "d", "turn": 3, "messages": [{"id": "three"}]})).await;
    assert_eq!(r.status, 201, "{:?}", r.json);
    let stored = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    assert_eq!(message_ids(&stored), ["two", "three"], "{stored}");

    // An id that is no single name of a path: escaped, the document is the one named.
    let r = post("/db", json!({"_id": "a/b c.d", "turn": 1, "messages": [{"id": "x"}]})).await;
    assert_eq!(r.status, 201, "{:?}", r.json);
    assert_eq!(r.json["id"], json!("a/b c.d"), "{:?}", r.json);
    let stored = direct
        .send(Method::GET, "/db/a%2Fb%20c.d", None, &[])
        .await
        .expect("read");
    assert_eq!(message_ids(&stored.json), ["x"], "{:?}", stored.json);

    // The store's own: a design document, a document without an id (the store names it).
    for (doc, id) in [
        (json!({"_id": "_design/v", "views": {}}), Some("_design/v")),
        (json!({"turn": 1, "messages": [{"id": "y"}]}), None),
    ] {
        let r = post("/db", doc.clone()).await;
        assert_eq!(r.status, 201, "{doc}: {:?}", r.json);
        let id = id.map_or_else(|| r.json["id"].as_str().expect("an id").to_owned(), str::to_owned);
        let path = format!("/db/{}", id.replace('/', "%2F"));
        let mut stored = direct.send(Method::GET, &path, None, &[]).await.expect("read").json;
        let object = stored.as_object_mut().expect("a document");
        object.remove("_rev");
        object.remove("_id");
        let mut sent = doc;
        sent.as_object_mut().expect("an object").remove("_id");
        assert_eq!(stored, sent, "stored as sent, no turnlock field");
    }

    // Refused rather than passed on unread: a coded body, a path the stores read two ways.
    let r = agent
        .send(
            Method::POST,
            "/db",
            Some(&json!({"_id": "d"})),
            &[("content-encoding", "gzip".to_owned())],
        )
        .await
        .expect("post");
    assert_eq!(r.status, 400, "{:?}", r.json);
    assert_eq!(
        r.json["turnlock_error"],
        json!("unsupported_content_encoding"),
        "{:?}",
        r.json
    );
    let r = post("//db", json!({"_id": "d", "turn": 9, "messages": []})).await;
    assert_eq!(r.status, 400, "{:?}", r.json);
    assert_eq!(r.json["turnlock_error"], json!("ambiguous_path"), "{:?}", r.json);
    // The store's own refusal of the write-back (pouchdb-server's 412 `missing_id` for the id
    // `null`) is answered as it came, not re-read as a conflict until the deadline (503).
    let r = post("/db", json!({"_id": "null", "turn": 1})).await;
    assert_eq!(r.status, 412, "{:?}", r.json);
    let r = post("/db", json!({"_id": "d", "turn": 9, "_deleted": true})).await;
    assert_eq!(r.status, 400, "{:?}", r.json);
    assert_eq!(r.json["turnlock_error"], json!("forbidden_field"), "{:?}", r.json);
    // A body the store reads otherwise than turnlock (pouchdb-server decodes UTF-7 and skips a
    // byte order mark), whether a POST or a PUT: refused.
    let utf7 = br#"{"+AF8-id":"d","turn":9,"messages":[]}"#.to_vec();
    let bom = [b"\xef\xbb\xbf".as_slice(), br#"{"_id":"d","turn":9,"messages":[]}"#].concat();
    for (target, charset, body, status, code) in [
        ("/db", "; charset=utf-7", &utf7, 415, "unsupported_charset"),
        ("/db/d", "; charset=utf-7", &utf7, 415, "unsupported_charset"),
        ("/db", "", &bom, 400, "malformed_json"),
        (
            "/db/_bulk_docs",
            "",
            &[b"{\"docs\":[".as_slice(), &bom, b"]}"].concat(),
            400,
            "malformed_json",
        ),
    ] {
        let method = if target == "/db/d" { "PUT" } else { "POST" };
        let head = format!(
            "{method} {target} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json{charset}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let answer = crate::support::send_raw(sidecar.addr, &[head.as_bytes(), body].concat()).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")) && answer.contains(code),
            "{method} {target}{charset}: {answer}"
        );
        // Named as CouchDB names its refusal of a body's content type.
        assert!(
            status != 415 || answer.contains(r#""error":"bad_content_type""#),
            "{method} {target}{charset}: {answer}"
        );
    }
    let stored = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    assert_eq!(message_ids(&stored), ["two", "three"], "{stored}");
}

/// A CouchDB write whose body came typed otherwise than `application/json` (a client's
/// `application/octet-stream`, a `+json` type, an empty `Content-Type`) is written back as
/// JSON: the store holds what was acknowledged, and an update of an existing document
/// applies rather than meeting a conflict no re-read resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_write_in_any_content_type_is_written_back_as_json() {
    let Couch { direct, sidecar, .. } = &couch(COUCHDB_ROUTES).await;
    for (i, content_type) in ["application/octet-stream", "application/merge-patch+json", ""]
        .into_iter()
        .enumerate()
    {
        let write = |method: &str, target: &str, body: String| {
            let head = format!(
                "{method} {target} HTTP/1.1\r\nhost: x\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let bytes = [head.into_bytes(), body.into_bytes()].concat();
            async move { crate::support::send_raw(sidecar.addr, &bytes).await }
        };
        let doc = format!("ct{i}");
        let put = format!("/db/{doc}");
        let answer = write("PUT", &put, r#"{"turn":1,"messages":[{"id":"a"}]}"#.to_owned()).await;
        assert!(answer.starts_with("HTTP/1.1 201"), "{content_type:?} create: {answer}");
        let answer = write("PUT", &put, r#"{"turn":2,"messages":[{"id":"b"}]}"#.to_owned()).await;
        assert!(answer.starts_with("HTTP/1.1 201"), "{content_type:?} update: {answer}");
        let body = format!(r#"{{"_id":"{doc}","turn":3,"messages":[{{"id":"c"}}]}}"#);
        let answer = write("POST", "/db", body).await;
        assert!(answer.starts_with("HTTP/1.1 201"), "{content_type:?} post: {answer}");
        // Beside a document of the store's own, sent on to it as JSON.
        let body = format!(
            r#"{{"docs":[{{"_id":"{doc}","turn":4,"messages":[{{"id":"d"}}]}},{{"_id":"_local/{doc}","x":1}}]}}"#
        );
        let answer = write("POST", "/db/_bulk_docs", body).await;
        assert!(answer.starts_with("HTTP/1.1 201"), "{content_type:?} bulk: {answer}");
        let stored = direct.send(Method::GET, &put, None, &[]).await.expect("read").json;
        assert_eq!(message_ids(&stored), ["a", "b", "c", "d"], "{content_type:?}: {stored}");
        assert_eq!(stored["turn"], json!(4), "{content_type:?}: {stored}");
    }
    // A type no write takes: the bulk write refused as a whole, as CouchDB refuses it.
    let body = br#"{"docs":[{"_id":"ct0","turn":9,"messages":[]}]}"#;
    let head = format!(
        "POST /db/_bulk_docs HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let answer = crate::support::send_raw(sidecar.addr, &[head.as_bytes(), body].concat()).await;
    assert!(answer.starts_with("HTTP/1.1 415"), "{answer}");
}

/// A replication writes its source's documents into its target as given, past the merge and
/// the turn check, and where its target is depends on the store's own reading of a URL:
/// through the sidecar every replication is refused (`POST /_replicate`, a `_replicator`
/// document, their `/_node/{node}/` spellings), whatever its target. A path pouchdb-server
/// serves as a session's document by cleaning its database's name is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_replication_through_the_sidecar_is_refused() {
    let routes = COUCHDB_ROUTES.replace("/{db}/{session}", "/sessions/{session}");
    let Couch {
        direct, agent, store, ..
    } = &couch(&routes).await;
    for db in ["/sessions", "/source", "/backup"] {
        let r = direct.send(Method::PUT, db, None, &[]).await.expect("create db");
        assert!(r.status.is_success(), "{db}: {}", r.status);
    }
    let r = agent
        .send(
            Method::PUT,
            "/sessions/s",
            Some(&json!({"turn": 3, "messages": [{"id": "c1"}]})),
            &[],
        )
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    // A higher revision of the same document in the source, as a replication would carry it.
    let as_given = json!({"new_edits": false, "docs": [
        {"_id": "s", "_rev": "50-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "turn": 0, "messages": []}
    ]});
    let r = direct
        .send(Method::POST, "/source/_bulk_docs", Some(&as_given), &[])
        .await
        .expect("seed");
    assert!(r.status.is_success(), "{:?}", r.json);
    let store_url = store.url();
    let to = |target: Value| json!({"source": "source", "target": target});
    for (method, path, body) in [
        (Method::POST, "/_replicate", to(json!("sessions"))),
        (Method::POST, "/_replicate", to(json!(format!("{store_url}/sessions")))),
        (
            Method::POST,
            "/_replicate",
            to(json!({"url": format!("{store_url}/x/../sessions")})),
        ),
        // pouchdb's replicator ends a URL at a line separator.
        (
            Method::POST,
            "/_replicate",
            to(json!(format!("{store_url}/sessions\u{2028}x"))),
        ),
        // A `/` in the user information, which pouchdb's URL reading allows.
        (
            Method::POST,
            "/_replicate",
            to(json!(format!("http://alice:1/x@{}/sessions", &store_url[7..]))),
        ),
        (Method::POST, "/_replicate", to(json!("backup"))),
        (Method::POST, "/%5Freplicate/", to(json!("sessions"))),
        (Method::POST, "/_node/node1@127.0.0.1/_replicate", to(json!("sessions"))),
        (Method::PUT, "/_replicator/r1", to(json!("sessions"))),
        (Method::POST, "/_replicator", to(json!("sessions"))),
        (
            Method::POST,
            "/_replicator/_bulk_docs",
            json!({"docs": [to(json!("sessions"))]}),
        ),
        (
            Method::PUT,
            "/_node/node1@127.0.0.1/_replicator/r2",
            to(json!("sessions")),
        ),
    ] {
        let r = agent
            .send(method.clone(), path, Some(&body), &[])
            .await
            .expect("replicate");
        assert_eq!(r.status, 400, "{method} {path} {body}: {:?}", r.json);
        assert_eq!(r.json["turnlock_error"], json!("replication_refused"), "{:?}", r.json);
    }
    let stored = direct
        .send(Method::GET, "/sessions/s", None, &[])
        .await
        .expect("read")
        .json;
    assert_eq!(message_ids(&stored), ["c1"], "{stored}");
    assert_eq!(stored["turn"], json!(3), "{stored}");
    let copied = direct.send(Method::GET, "/backup/s", None, &[]).await.expect("read");
    assert_eq!(copied.status, 404, "nothing replicated: {:?}", copied.json);
    // A path pouchdb-server serves as a session's document by dropping a `/` from the
    // database's name: refused, a write and a bulk write as given alike.
    let older = json!({"_rev": stored["_rev"], "turn": 1, "messages": [{"id": "old"}]});
    let r = agent
        .send(Method::PUT, "/sessions%2F/s", Some(&older), &[])
        .await
        .expect("write");
    assert_eq!(r.status, 400, "{:?}", r.json);
    assert_eq!(r.json["turnlock_error"], json!("ambiguous_path"), "{:?}", r.json);
    let r = agent
        .send(Method::POST, "/sessions%2F/_bulk_docs", Some(&as_given), &[])
        .await
        .expect("bulk");
    assert_eq!(r.status, 400, "{:?}", r.json);
    let stored = direct
        .send(Method::GET, "/sessions/s", None, &[])
        .await
        .expect("read")
        .json;
    assert_eq!(stored["turn"], json!(3), "{stored}");
}

/// pouchdb-server writes the document a `PUT`'s JSON body names by `_id` (else its `?id=`)
/// ahead of the path's, strips its node's prefix from a path with a pattern a `?` or a `/`
/// matches, and stores a database whose name it cleans to nothing as `____`: through the
/// sidecar none of these writes a session's document past the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_writes_the_store_lands_on_a_sessions_document_are_refused() {
    let Couch {
        direct, agent, sidecar, ..
    } = &couch(&couchdb_with_delete()).await;
    let rev = written_rev(agent, direct, &json!({"turn": 5, "messages": [{"id": "five"}]})).await;
    let older = json!({"_id": "d", "_rev": rev, "turn": 1, "messages": []});
    let without_id = json!({"_rev": rev, "turn": 1, "messages": []});
    for (method, path, body, code) in [
        (Method::PUT, "/db/_local/x", &older, "id_elsewhere"),
        (Method::PUT, "/db/_design/x", &older, "id_elsewhere"),
        (Method::PUT, "/db/_local/y?id=d", &without_id, "id_elsewhere"),
        (
            Method::PUT,
            "/_node/node1@127.0.0.1/db/d",
            &without_id,
            "node_path_refused",
        ),
        (
            Method::PUT,
            "/_node/node1@127?0.0.1/db/d",
            &without_id,
            "node_path_refused",
        ),
        (
            Method::PUT,
            "/_node/node1@127/0/0/1/db/d",
            &without_id,
            "node_path_refused",
        ),
        (
            Method::POST,
            "/_node/node1@127?0.0.1/db/_bulk_docs",
            &json!({"docs": [older.clone()]}),
            "node_path_refused",
        ),
        (
            Method::DELETE,
            &format!("/_node/node1@127?0.0.1/db/d?rev={rev}"),
            &json!({}),
            "node_path_refused",
        ),
        (
            Method::POST,
            "/_node/node1@127?0.0.1/_replicate",
            &json!({"source": "x", "target": "db"}),
            "node_path_refused",
        ),
    ] {
        let r = agent.send(method.clone(), path, Some(body), &[]).await.expect("send");
        assert_eq!(r.status, 400, "{method} {path}: {:?}", r.json);
        assert_eq!(r.json["turnlock_error"], json!(code), "{method} {path}: {:?}", r.json);
    }
    // A multipart body, whose JSON part names the document the store writes.
    for path in ["/db/_local/m", "/db/_design/m"] {
        let part = format!(
            "--B\r\nContent-Type: application/json\r\n\r\n{}\r\n--B--\r\n",
            json!({"_id": "d", "_rev": rev, "turn": 0, "messages": []})
        );
        let head = format!(
            "PUT {path} HTTP/1.1\r\nhost: x\r\ncontent-type: multipart/related; boundary=B\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            part.len()
        );
        let answer = crate::support::send_raw(sidecar.addr, &[head, part].concat().into_bytes()).await;
        assert!(
            answer.starts_with("HTTP/1.1 400") && answer.contains("id_elsewhere"),
            "{path}: {answer}"
        );
    }
    let kept = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    assert_eq!(kept["turn"], json!(5), "{kept}");
    assert_eq!(message_ids(&kept), ["five"], "{kept}");
    // A design document naming itself, and the database's own PUT, are the store's.
    let design = json!({"_id": "_design/v", "views": {}});
    let r = agent
        .send(Method::PUT, "/db/_design/v", Some(&design), &[])
        .await
        .expect("design");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let r = agent
        .send(
            Method::PUT,
            "/other",
            None,
            &[("content-type", "application/json".to_owned())],
        )
        .await
        .expect("create");
    assert!(r.status.is_success(), "{:?}", r.json);
    // `____` is where pouchdb-server keeps `/%3F/…`: both spellings refused, not two locks.
    for path in ["/%3F/d", "/____/d", "/.../d"] {
        let r = agent
            .send(Method::PUT, path, Some(&without_id), &[])
            .await
            .expect("write");
        assert_eq!(r.status, 400, "{path}: {:?}", r.json);
        assert_eq!(
            r.json["turnlock_error"],
            json!("ambiguous_path"),
            "{path}: {:?}",
            r.json
        );
    }
}

/// A write's log line states the status its client got, in the route's dialect: CouchDB's
/// `201` for a merged write of a document that existed, not the `200` of turnlock's own answer
/// it was made from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dialect_writes_log_line_states_the_status_its_client_got() {
    let store = pouchdb_server();
    let redis = RedisServer::start();
    let routes = routes_file(COUCHDB_ROUTES);
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("proxy.log");
    let routes_arg = routes.path().display().to_string();
    let (proc, addr) = crate::support::Proc::logged_proxy(
        format!("127.0.0.1:{}", store.port).parse().expect("addr"),
        &["--redis", &redis.url(), "--routes", &routes_arg],
        &log,
    );
    let direct = JsonClient::new(store.url());
    let agent = JsonClient::new(format!("http://{addr}"));
    assert!(direct
        .send(Method::PUT, "/db", None, &[])
        .await
        .expect("db")
        .status
        .is_success());
    // A document created, then changed: CouchDB answers both 201.
    for turn in [2, 3] {
        let r = agent
            .send(Method::PUT, "/db/d", Some(&json!({"turn": turn, "messages": []})), &[])
            .await
            .expect("write");
        assert_eq!(r.status, 201, "{:?}", r.json);
    }
    let r = agent
        .send(Method::PUT, "/db/d", Some(&json!({"turn": 1, "messages": []})), &[])
        .await
        .expect("write");
    assert_eq!(r.status, 409, "{:?}", r.json);
    proc.signal("TERM");
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    drop(proc);
    let text = std::fs::read_to_string(&log).expect("read log");
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(" write route=") && l.contains(r#"session="d."#))
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    for line in &lines[..2] {
        assert!(
            line.contains("status=201") && line.contains(r#"outcome="ok""#),
            "{text}"
        );
    }
    assert!(
        lines[2].contains("status=409") && lines[2].contains(r#"outcome="stale_turn""#),
        "{text}"
    );
}

/// CouchDB's `POST /{db}/_bulk_docs` (nano's `db.bulk`, PouchDB's `bulkDocs`): the sessions'
/// documents in it are written as their `PUT`s (locked, merged, turn-checked), the others by
/// the store; one entry per document, in order, as CouchDB answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_bulk_write_writes_sessions_documents_as_their_locked_puts() {
    let Couch { direct, agent, .. } = &couch(COUCHDB_ROUTES).await;
    written_rev(agent, direct, &json!({"turn": 2, "messages": [{"id": "two"}]})).await;
    let bulk = |body: Value| async move {
        agent
            .send(Method::POST, "/db/_bulk_docs", Some(&body), &[])
            .await
            .expect("bulk")
    };
    let r = bulk(json!({"docs": [
        {"_id": "other", "x": 1},
        {"_id": "d", "turn": 3, "messages": [{"id": "three"}]},
        {"_id": "d2", "turn": 1, "messages": [{"id": "x"}]},
        {"_id": "d", "turn": 1, "messages": [{"id": "old"}]},
        {"_id": "_design/v", "views": {}},
    ]}))
    .await;
    assert_eq!(r.status, 201, "{:?}", r.json);
    let entries = r.json.as_array().expect("one entry per document").clone();
    let ids: Vec<&str> = entries.iter().map(|e| e["id"].as_str().unwrap_or("?")).collect();
    assert_eq!(ids, ["other", "d", "d2", "d", "_design/v"], "{:?}", r.json);
    for i in [0, 1, 2, 4] {
        assert_eq!(entries[i]["ok"], json!(true), "{i}: {:?}", r.json);
        assert!(
            entries[i]["rev"].as_str().is_some_and(|r| r.contains('-')),
            "{:?}",
            r.json
        );
    }
    assert_eq!(entries[3]["error"], json!("conflict"), "an older turn: {:?}", r.json);
    assert_eq!(entries[3]["turnlock_error"], json!("stale_turn"), "{:?}", r.json);
    let read = |path: &'static str| async move { direct.send(Method::GET, path, None, &[]).await.expect("read").json };
    assert_eq!(message_ids(&read("/db/d").await), ["two", "three"]);
    assert_eq!(message_ids(&read("/db/d2").await), ["x"]);
    assert_eq!(
        read("/db/other").await["x"],
        json!(1),
        "every document of /db is a session's"
    );
    let mut design = read("/db/_design%2Fv").await;
    let design = design.as_object_mut().expect("a document");
    design.remove("_rev");
    assert_eq!(
        Value::Object(design.clone()),
        json!({"_id": "_design/v", "views": {}}),
        "the store's, untouched"
    );

    // A session's document deleted in bulk: refused, kept; a bulk of the store's documents
    // alone, even as given (replication), is the store's own.
    let rev = read("/db/d").await["_rev"].as_str().expect("a _rev").to_owned();
    let r = bulk(json!({"docs": [{"_id": "d", "_rev": rev, "_deleted": true}]})).await;
    assert_eq!(r.status, 201, "{:?}", r.json);
    assert_eq!(r.json[0]["turnlock_error"], json!("forbidden_field"), "{:?}", r.json);
    assert_eq!(message_ids(&read("/db/d").await), ["two", "three"]);
    let r = bulk(json!({"new_edits": false, "docs": [{"_id": "d", "_rev": "9-abc", "messages": []}]})).await;
    assert_eq!(r.status, 400, "{:?}", r.json);
    assert_eq!(r.json["turnlock_error"], json!("bulk_as_given"), "{:?}", r.json);
    assert_eq!(message_ids(&read("/db/d").await), ["two", "three"]);
    for as_given in [json!(0), Value::Null, json!(""), json!("false")] {
        let r = bulk(json!({"new_edits": as_given, "docs": [{"_id": "d", "_rev": "9-abc", "messages": []}]})).await;
        assert_eq!(r.status, 400, "{as_given}: {:?}", r.json);
        assert_eq!(r.json["turnlock_error"], json!("bulk_as_given"), "{:?}", r.json);
    }
    assert_eq!(message_ids(&read("/db/d").await), ["two", "three"]);
    let r = bulk(json!({"new_edits": false, "docs": [{"_id": "_local/x", "_rev": "0-1", "y": 2}]})).await;
    assert!(r.status.is_success(), "{:?}", r.json);

    // A bulk write's key names its entries' records, and no single write's key names them:
    // `KZ` for a bulk and `KZ:0` for a write of its first document are two requests.
    let keyed = json!({"docs": [{"_id": "keyed", "turn": 1, "messages": [{"id": "k1"}]}]});
    let r = agent
        .send(
            Method::POST,
            "/db/_bulk_docs",
            Some(&keyed),
            &[("idempotency-key", "KZ".to_owned())],
        )
        .await
        .expect("bulk");
    assert_eq!(r.json[0]["ok"], json!(true), "{:?}", r.json);
    let r = agent
        .send(
            Method::POST,
            "/db/_bulk_docs",
            Some(&keyed),
            &[("idempotency-key", "KZ".to_owned())],
        )
        .await
        .expect("bulk again");
    assert_eq!(r.json[0]["ok"], json!(true), "the replay: {:?}", r.json);
    let single = json!({"turn": 2, "messages": [{"id": "k2"}]});
    let r = agent
        .send(
            Method::PUT,
            "/db/keyed",
            Some(&single),
            &[("idempotency-key", "KZ:0".to_owned())],
        )
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
    assert_eq!(message_ids(&read("/db/keyed").await), ["k1", "k2"]);

    // One document listed several times, at rising turns: written in the list's order, each
    // entry applied (none refused as older than a later entry that went first).
    for round in 0..8 {
        let id = format!("ordered-{round}");
        let docs: Vec<Value> = (1..=5)
            .map(|turn| json!({"_id": id, "turn": turn, "messages": [{"id": format!("m{turn}")}]}))
            .collect();
        let r = bulk(json!({ "docs": docs })).await;
        assert_eq!(r.status, 201, "{:?}", r.json);
        let entries = r.json.as_array().expect("entries");
        assert!(
            entries.iter().all(|e| e["ok"] == json!(true)),
            "round {round}: {:?}",
            r.json
        );
        let stored = direct
            .send(Method::GET, &format!("/db/{id}"), None, &[])
            .await
            .expect("read")
            .json;
        assert_eq!(message_ids(&stored), ["m1", "m2", "m3", "m4", "m5"], "{stored}");
    }
}

/// `If-Match` on a CouchDB write is the store's precondition (a `_rev` in the body or
/// `?rev=` is not needed, see the README): naming a revision of a document the store does
/// not hold, it is a conflict to CouchDB, not a missing document. The sidecar answers it as
/// the store does, and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_if_match_on_a_missing_document_is_a_conflict_as_at_the_store() {
    let Couch { direct, agent, .. } = &couch(COUCHDB_ROUTES).await;
    let rev = "1-967a00dff5e02add41819138abb3284d";
    let at_store = direct
        .send(
            Method::PUT,
            "/db/nobody",
            Some(&json!({"_rev": rev, "turn": 1, "messages": []})),
            &[],
        )
        .await
        .expect("direct write");
    assert_eq!(at_store.status, 409, "the store: {:?}", at_store.json);
    let body = json!({"turn": 1, "messages": [{"id": "a"}]});
    let headers = [("if-match", format!("\"{rev}\""))];
    let r = agent
        .send(Method::PUT, "/db/absent", Some(&body), &headers)
        .await
        .expect("write");
    assert_eq!(r.status, 409, "{:?}", r.json);
    assert_eq!(r.json["error"], at_store.json["error"], "{:?}", r.json);
    let stored = direct.send(Method::GET, "/db/absent", None, &[]).await.expect("read");
    assert_eq!(stored.status, 404, "nothing written: {:?}", stored.json);
}

/// Writes that land on a session's document by other means than its path, found from the
/// outside against pouchdb-server: a virtual host set through `/_config` (it rewrites the
/// paths of the sidecar's own write-backs), a `COPY` onto the document, a design document's
/// update function or rewrite, a `_purge`, and the deletion of the database. Each is refused
/// before it reaches the store, the document keeps its turn and messages, and reads, a
/// database's creation and a login still pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_writes_past_the_lock_by_other_means_than_the_path_are_refused() {
    let Couch {
        direct,
        agent,
        sidecar,
        store,
        ..
    } = &couch(&couchdb_with_delete()).await;
    let rev = written_rev(agent, direct, &json!({"turn": 5, "messages": [{"id": "five"}]})).await;
    let r = direct
        .send(
            Method::PUT,
            "/db/evil",
            Some(&json!({"turn": 1, "messages": [{"id": "evil"}]})),
            &[],
        )
        .await
        .expect("a document beside it");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let update = json!({"_id": "_design/u",
        "updates": {
            "f": "function(doc, req) { doc.messages = []; doc.turn = 999999; return [doc, 'ok']; }"
        },
        "rewrites": [{"from": "a", "to": "../../d"}, {"from": "u", "to": "_update/f/d"}]
    });
    let r = direct
        .send(Method::PUT, "/db/_design/u", Some(&update), &[])
        .await
        .expect("design");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let vhost = format!(
        "/_config/vhosts/{}",
        store.url().trim_start_matches("http://").trim_end_matches('/')
    );
    let hidden_in_query = format!("/db/_local/q?rev={rev}&q=/db/_design/u/_rewrite/a");
    let store_wide: [(&str, &str, Option<Value>); 14] = [
        ("PUT", &vhost, Some(json!("/db"))),
        ("PUT", "/_config/couchdb/max_document_size", Some(json!("1"))),
        ("PUT", "/%5Fconfig/vhosts/x", Some(json!("/db"))),
        ("PUT", "/./_config/vhosts/x", Some(json!("/db"))),
        ("PUT", "/x/%2E%2E/_config/vhosts/x", Some(json!("/db"))),
        ("POST", "/db/_design/u/_update/f/d", Some(json!({}))),
        (
            "PUT",
            "/db/_design/u/_rewrite/d",
            Some(json!({"turn": 0, "messages": []})),
        ),
        ("POST", "/db/_purge", Some(json!({"d": [rev.clone()]}))),
        ("DELETE", "/db", None),
        ("DELETE", "/db/", None),
        // pouchdb-server finds a rewrite anywhere in the target: after a prefix, in the query.
        ("PUT", "/x/db/_design/u/_rewrite/a", Some(json!({}))),
        ("POST", "/db/_find?q=/db/_design/u/_rewrite/u", Some(json!({}))),
        ("DELETE", &hidden_in_query, None),
        (
            "POST",
            "/db/_find?q=%2Fdb%2F_design%2Fu%2F_rewrite%2Fu",
            Some(json!({})),
        ),
    ];
    for (method, path, body) in &store_wide {
        let method = Method::from_bytes(method.as_bytes()).expect("method");
        let r = agent
            .send(method.clone(), path, body.as_ref(), &[])
            .await
            .expect("send");
        assert_eq!(r.status, 400, "{method} {path}: {:?}", r.json);
        assert_eq!(
            r.json["turnlock_error"],
            json!("unlocked_write_refused"),
            "{method} {path}: {:?}",
            r.json
        );
    }
    let copy = format!(
        "COPY /db/evil HTTP/1.1\r\nhost: x\r\ndestination: d?rev={rev}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    );
    let answer = crate::support::send_raw(sidecar.addr, copy.as_bytes()).await;
    assert!(
        answer.starts_with("HTTP/1.1 400") && answer.contains("unlocked_write_refused"),
        "COPY: {answer}"
    );
    let kept = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    assert_eq!(kept["turn"], json!(5), "{kept}");
    assert_eq!(message_ids(&kept), ["five"], "{kept}");
    let config = direct
        .send(Method::GET, "/_config/vhosts", None, &[])
        .await
        .expect("config");
    assert_eq!(config.json, json!({}), "no virtual host was set: {:?}", config.json);
    // Reads, a database's creation and a login pass.
    let r = agent
        .send(Method::GET, "/_config/vhosts", None, &[])
        .await
        .expect("read config");
    assert_eq!(r.status, 200, "{:?}", r.json);
    let r = agent.send(Method::PUT, "/other", None, &[]).await.expect("create");
    assert!(r.status.is_success(), "{:?}", r.json);
    let r = agent
        .send(
            Method::POST,
            "/_session",
            Some(&json!({"name": "n", "password": "p"})),
            &[],
        )
        .await
        .expect("login");
    assert_ne!(r.status, 400, "a login is the store's to answer: {:?}", r.json);
    assert!(r.json.get("turnlock_error").is_none(), "{:?}", r.json);
    // The session is written on as before.
    let r = agent
        .send(
            Method::PUT,
            "/db/d",
            Some(&json!({"turn": 6, "messages": [{"id": "six"}]})),
            &[],
        )
        .await
        .expect("write");
    assert_eq!(r.status, 201, "{:?}", r.json);
}

/// A session delete sends the store its `?rev=` and no other parameter: pouchdb-server reads
/// any other as a write option, and with `new_edits=` (empty) answered 200 to a delete it did
/// not make.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_session_delete_sends_the_store_its_rev_alone() {
    let Couch { direct, agent, .. } = &couch(&couchdb_with_delete()).await;
    let rev = written_rev(agent, direct, &json!({"turn": 5, "messages": [{"id": "five"}]})).await;
    let r = agent
        .send(
            Method::DELETE,
            &format!("/db/d?new_edits=&r%65v={rev}&batch=ok"),
            None,
            &[],
        )
        .await
        .expect("delete");
    assert_eq!(r.status, 200, "{:?}", r.json);
    assert_eq!(r.json["ok"], json!(true), "CouchDB's answer to a delete: {:?}", r.json);
    let gone = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read");
    assert_eq!(gone.status, 404, "deleted: {:?}", gone.json);
}

/// A copy that dropped turnlock's fields (no `version`) but kept the `_rev` it was read at
/// is the client's whole document at that revision: written onto a later one, its stale
/// fields would undo acknowledged writes. It is refused 409 `conflict`, as CouchDB refuses
/// it; at the current revision it is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn couchdb_a_copy_without_a_version_at_an_old_rev_is_a_conflict() {
    let Couch { direct, agent, .. } = &couch(COUCHDB_ROUTES).await;
    let first = json!({"turn": 1, "state": {"a": 1}, "messages": [{"id": "m1"}]});
    written_rev(agent, direct, &first).await;
    let mut a = agent.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    let mut careless = a.clone();
    for field in ["version", "life", "session"] {
        careless.as_object_mut().expect("a document").remove(field);
    }
    a["state"] = json!({"a": 2, "x": "A"});
    let r = agent.send(Method::PUT, "/db/d", Some(&a), &[]).await.expect("A");
    assert_eq!(r.status, 201, "{:?}", r.json);
    careless["messages"]
        .as_array_mut()
        .expect("messages")
        .push(json!({"id": "mB"}));
    let r = agent.send(Method::PUT, "/db/d", Some(&careless), &[]).await.expect("B");
    assert_eq!(r.status, 409, "{:?}", r.json);
    assert_eq!(r.json["error"], json!("conflict"), "{:?}", r.json);
    // The same copy naming its revision in the query, which the store takes for its `_rev`.
    let mut by_query = careless.clone();
    let old_rev = by_query
        .as_object_mut()
        .expect("a document")
        .remove("_rev")
        .expect("a _rev");
    let path = format!("/db/d?rev={}", old_rev.as_str().expect("a string"));
    let r = agent
        .send(Method::PUT, &path, Some(&by_query), &[])
        .await
        .expect("B by query");
    assert_eq!(r.status, 409, "{:?}", r.json);
    let stored = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    assert_eq!(stored["state"], json!({"a": 2, "x": "A"}), "A's write kept: {stored}");
    // Read again, at the current `_rev`: written.
    careless["_rev"] = stored["_rev"].clone();
    careless["state"] = stored["state"].clone();
    let r = agent
        .send(Method::PUT, "/db/d", Some(&careless), &[])
        .await
        .expect("B again");
    assert_eq!(r.status, 201, "{:?}", r.json);
    let stored = direct.send(Method::GET, "/db/d", None, &[]).await.expect("read").json;
    assert_eq!(message_ids(&stored), ["m1", "mB"], "{stored}");
}
