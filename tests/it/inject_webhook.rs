//! The sidecar-injection webhook over real HTTPS: AdmissionReviews shaped the way the API
//! server sends them, the returned JSON Patch applied to the pod with a JSON Patch library,
//! and the resulting pod checked against the Kubernetes types (no unknown or mistyped field).

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use turnlock::inject::annotations as a;
use turnlock::inject::certs;
use turnlock::inject::server::{self, Running};
use turnlock::inject::WebhookArgs;

/// The name the API server uses to reach the webhook's Service.
const SERVICE_DNS: &str = "turnlock-injector.turnlock-system.svc";

struct Webhook {
    running: Running,
    connector: TlsConnector,
    dir: tempfile::TempDir,
}

/// A TLS client that trusts only the given CA.
fn trusting(ca_pem: &str) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA pem");
    roots.add(ca).expect("CA added");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

impl Webhook {
    async fn start(configure: impl FnOnce(&mut WebhookArgs)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let names = certs::service_names("turnlock-injector", "turnlock-system");
        let generated = certs::generate(&names, 1).expect("certificates");
        let cert = dir.path().join("tls.crt");
        let key = dir.path().join("tls.key");
        std::fs::write(&cert, &generated.cert).expect("write cert");
        std::fs::write(&key, &generated.key).expect("write key");
        std::fs::write(dir.path().join("ca.crt"), &generated.ca_cert).expect("write CA");
        let mut args = WebhookArgs::local(cert, key);
        args.upstream = Some("http://context-store.agents.svc:8080".into());
        args.redis = Some("redis://redis.turnlock-system.svc:6379".into());
        configure(&mut args);
        let running = server::start(args).await.expect("webhook starts");

        Self {
            running,
            connector: trusting(&generated.ca_cert),
            dir,
        }
    }

    /// Whether a client trusting only `connector`'s CA completes a TLS handshake.
    async fn handshake_ok(&self, connector: &TlsConnector) -> bool {
        let Ok(tcp) = TcpStream::connect(self.running.addr).await else {
            return false;
        };
        let name = ServerName::try_from(SERVICE_DNS).expect("server name");
        connector.connect(name, tcp).await.is_ok()
    }

    /// One HTTPS request, verified against the generated CA for the Service's DNS name.
    async fn send(&self, method: http::Method, path: &str, body: Vec<u8>) -> (StatusCode, Value) {
        let tcp = TcpStream::connect(self.running.addr).await.expect("connect");
        let name = ServerName::try_from(SERVICE_DNS).expect("server name");
        let tls = self.connector.connect(name, tcp).await.expect("TLS handshake");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .expect("HTTP handshake");
        tokio::spawn(conn);
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, SERVICE_DNS)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        let res = sender.send_request(req).await.expect("response");
        let status = res.status();
        let bytes = res.into_body().collect().await.expect("body").to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, json)
    }

    async fn review(&self, path: &str, review: &Value) -> Value {
        let (status, body) = self
            .send(http::Method::POST, path, serde_json::to_vec(review).expect("json"))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(body["kind"], "AdmissionReview");
        assert_eq!(
            body["response"]["uid"], review["request"]["uid"],
            "the answer echoes the uid"
        );
        body["response"].clone()
    }
}

/// A pod as the API server hands it to mutating webhooks: defaults filled in, the service
/// account token volume already added, no name yet (generateName from its ReplicaSet).
fn pod(annotations: Value) -> Value {
    json!({
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "generateName": "agent-7d9f8c6b5-",
            "namespace": "agents",
            "creationTimestamp": null,
            "labels": {"app": "agent", "pod-template-hash": "7d9f8c6b5"},
            "annotations": annotations,
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "agent-7d9f8c6b5",
                "uid": "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "controller": true, "blockOwnerDeletion": true
            }]
        },
        "spec": {
            "volumes": [{
                "name": "kube-api-access-x7k2p",
                "projected": {
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}
                    ],
                    "defaultMode": 420
                }
            }],
            "containers": [{
                "name": "agent",
                "image": "example.com/agent:1.4.2",
                "env": [
                    {"name": "CONTEXT_STORE_URL", "value": "http://context-store.agents.svc:8080"},
                    {"name": "MODEL", "value": "large"}
                ],
                "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
                "volumeMounts": [{"name": "kube-api-access-x7k2p", "readOnly": true, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent"
            }],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "serviceAccount": "default",
            "securityContext": {},
            "schedulerName": "default-scheduler",
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            ],
            "priority": 0,
            "enableServiceLinks": true,
            "preemptionPolicy": "PreemptLowerPriority"
        },
        "status": {}
    })
}

fn review_of(object: Value, kind: (&str, &str, &str), resource: &str) -> Value {
    let (group, version, k) = kind;
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("705ab4f5-6393-11e8-b7cc-{:012x}", rand_suffix()),
            "kind": {"group": group, "version": version, "kind": k},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": k},
            "requestResource": {"group": group, "version": version, "resource": resource},
            "namespace": "agents",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller", "uid": "7c1a", "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": object,
            "oldObject": null,
            "dryRun": false,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
        }
    })
}

fn pod_review(pod: Value) -> Value {
    review_of(pod, ("", "v1", "Pod"), "pods")
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(1);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Decodes the response's patch and applies it to `pod` with the JSON Patch library.
fn apply(pod: &Value, response: &Value) -> Value {
    assert_eq!(response["allowed"], true, "{response}");
    assert_eq!(response["patchType"], "JSONPatch", "{response}");
    let raw: k8s_openapi::ByteString = serde_json::from_value(response["patch"].clone()).expect("base64 patch");
    let patch: json_patch::Patch = serde_json::from_slice(&raw.0).expect("a JSON Patch");
    let mut patched = pod.clone();
    json_patch::patch(&mut patched, &patch).expect("the patch applies to the pod it was made for");
    patched
}

/// The pod must deserialize into the Kubernetes `Pod` type and serialize back to itself: any
/// unknown, misspelt or mistyped field (or a missing required one) fails.
fn assert_valid_pod(pod: &Value) -> Pod {
    let typed: Pod = serde_json::from_value(pod.clone()).expect("the patched pod is a valid Pod");
    let back = serde_json::to_value(&typed).expect("serialize");
    assert_eq!(
        strip_nulls(back),
        strip_nulls(pod.clone()),
        "fields lost in a round trip are not part of the schema"
    );
    typed
}

fn strip_nulls(v: Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, strip_nulls(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.into_iter().map(strip_nulls).collect()),
        other => other,
    }
}

fn env_of<'a>(c: &'a k8s_openapi::api::core::v1::Container, name: &str) -> Option<&'a str> {
    c.env.as_ref()?.iter().find(|e| e.name == name)?.value.as_deref()
}

#[tokio::test]
async fn opted_in_pod_gets_a_native_sidecar_that_the_agent_waits_for() {
    let hook = Webhook::start(|_| {}).await;
    let original = pod(json!({
        a::INJECT: "true",
        a::NATIVE_SIDECAR: "true",
        a::STORE_URL_ENV: "CONTEXT_STORE_URL",
        a::LOCK_BUDGET_MS: "80",
        a::WAIT_DEADLINE_MS: "5000",
        a::REDIS_SECRET: "redis-auth/url",
        a::MEMORY_LIMIT: "96Mi",
        a::LOG_LEVEL: "turnlock=debug",
    }));
    let response = hook.review("/inject", &pod_review(original.clone())).await;
    let patched = apply(&original, &response);
    let typed = assert_valid_pod(&patched);
    let spec = typed.spec.expect("spec");

    let init = spec.init_containers.expect("init containers");
    let sidecar = &init[0];
    assert_eq!(sidecar.name, "turnlock");
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"), "a native sidecar");
    let startup = sidecar
        .startup_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("startup probe");
    assert_eq!(startup.path.as_deref(), Some("/readyz"));
    assert!(sidecar.readiness_probe.is_some() && sidecar.liveness_probe.is_some());
    assert_eq!(sidecar.args.as_deref(), Some(&["proxy".to_owned()][..]));
    assert_eq!(
        env_of(sidecar, "TURNLOCK_UPSTREAM"),
        Some("http://context-store.agents.svc:8080")
    );
    assert_eq!(env_of(sidecar, "TURNLOCK_LOCK_BUDGET_MS"), Some("80"));
    assert_eq!(env_of(sidecar, "TURNLOCK_WAIT_DEADLINE_MS"), Some("5000"));
    assert_eq!(env_of(sidecar, "TURNLOCK_LISTEN"), Some("127.0.0.1:7070"));
    assert_eq!(env_of(sidecar, "RUST_LOG"), Some("turnlock=debug"));
    let redis = sidecar
        .env
        .as_ref()
        .and_then(|e| e.iter().find(|v| v.name == "TURNLOCK_REDIS"))
        .and_then(|v| v.value_from.as_ref())
        .and_then(|f| f.secret_key_ref.as_ref())
        .expect("Redis URL from the secret");
    assert_eq!((redis.name.as_str(), redis.key.as_str()), ("redis-auth", "url"));
    let sc = sidecar.security_context.as_ref().expect("security context");
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let limits = sidecar
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .expect("limits");
    assert_eq!(limits["memory"].0, "96Mi");
    assert!(
        !limits.contains_key("cpu"),
        "a CPU limit invites throttling: {limits:?}"
    );
    assert!(sidecar.resources.as_ref().and_then(|r| r.requests.as_ref()).is_some());

    assert_eq!(spec.containers.len(), 1, "the sidecar is not also a regular container");
    let agent = &spec.containers[0];
    assert_eq!(env_of(agent, "CONTEXT_STORE_URL"), Some("http://127.0.0.1:7070"));
    assert_eq!(env_of(agent, "MODEL"), Some("large"), "other env vars are kept");
    assert_eq!(
        agent.env.as_ref().map(Vec::len),
        Some(2),
        "the variable is replaced, not duplicated"
    );
    let annotations = typed.metadata.annotations.expect("annotations");
    assert!(annotations.contains_key(a::STATUS));
    assert!(
        response.get("warnings").is_none(),
        "Redis and the env var are configured: {response}"
    );
}

#[tokio::test]
async fn regular_container_when_native_sidecars_are_off() {
    let hook = Webhook::start(|_| {}).await;
    let original = pod(json!({a::INJECT: "true", a::STORE_URL_ENV: "CONTEXT_STORE_URL"}));
    let response = hook.review("/inject", &pod_review(original.clone())).await;
    let typed = assert_valid_pod(&apply(&original, &response));
    let spec = typed.spec.expect("spec");
    assert!(spec.init_containers.unwrap_or_default().is_empty());
    let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["agent", "turnlock"]);
    assert_eq!(spec.containers[1].restart_policy, None);
    assert_eq!(
        env_of(&spec.containers[1], "TURNLOCK_REDIS"),
        Some("redis://redis.turnlock-system.svc:6379"),
        "the cluster default"
    );
}

#[tokio::test]
async fn native_sidecar_by_global_default_and_opt_out_by_annotation() {
    let hook = Webhook::start(|a| a.native_sidecar = true).await;
    let original = pod(json!({a::INJECT: "true"}));
    let response = hook.review("/inject", &pod_review(original.clone())).await;
    let typed = assert_valid_pod(&apply(&original, &response));
    assert_eq!(
        typed.spec.expect("spec").init_containers.expect("init")[0].name,
        "turnlock"
    );
    let warnings = response["warnings"].as_array().expect("warns about the agent's URL");
    assert!(warnings
        .iter()
        .any(|w| w.as_str().unwrap_or("").contains("store-url-env")));

    let original = pod(json!({a::INJECT: "true", a::NATIVE_SIDECAR: "false"}));
    let response = hook.review("/inject", &pod_review(original.clone())).await;
    let typed = assert_valid_pod(&apply(&original, &response));
    assert!(typed
        .spec
        .expect("spec")
        .containers
        .iter()
        .any(|c| c.name == "turnlock"));
}

#[tokio::test]
async fn pods_are_injected_only_when_opted_in() {
    let hook = Webhook::start(|_| {}).await;
    // Reached through the opt-in webhook: no annotation, no sidecar.
    let plain = pod(json!({}));
    let response = hook.review("/inject", &pod_review(plain.clone())).await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none(), "{response}");

    // A namespace labelled for injection: every pod gets it ...
    let response = hook.review("/inject/namespace", &pod_review(plain.clone())).await;
    assert_valid_pod(&apply(&plain, &response));

    // ... unless the pod opts out.
    let opted_out = pod(json!({a::INJECT: "false"}));
    let response = hook.review("/inject/namespace", &pod_review(opted_out)).await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none(), "{response}");

    // A pod label opts in too.
    let mut labelled = pod(json!({}));
    labelled["metadata"]["labels"][a::INJECT] = json!("true");
    let response = hook.review("/inject", &pod_review(labelled.clone())).await;
    assert_valid_pod(&apply(&labelled, &response));
}

#[tokio::test]
async fn an_injected_pod_is_not_patched_again_on_reinvocation() {
    let hook = Webhook::start(|a| a.native_sidecar = true).await;
    let original = pod(json!({a::INJECT: "true", a::STORE_URL_ENV: "CONTEXT_STORE_URL"}));
    let once = apply(&original, &hook.review("/inject", &pod_review(original.clone())).await);
    let again = hook.review("/inject", &pod_review(once.clone())).await;
    assert_eq!(again["allowed"], true);
    assert!(
        again.get("patch").is_none(),
        "reinvocation must not add a second sidecar: {again}"
    );

    // Also when another webhook dropped the status annotation but kept the container.
    let mut without_status = once.clone();
    without_status["metadata"]["annotations"]
        .as_object_mut()
        .expect("annotations")
        .remove(a::STATUS);
    let again = hook.review("/inject", &pod_review(without_status)).await;
    assert!(again.get("patch").is_none(), "{again}");
}

#[tokio::test]
async fn transparent_mode_adds_the_iptables_init_container_and_leaves_the_agent_alone() {
    let hook = Webhook::start(|a| a.native_sidecar = true).await;
    let original = pod(json!({a::INJECT: "true", a::TRANSPARENT: "true", a::INTERCEPT_PORTS: "8080"}));
    let response = hook.review("/inject", &pod_review(original.clone())).await;
    let typed = assert_valid_pod(&apply(&original, &response));
    let spec = typed.spec.expect("spec");
    let init = spec.init_containers.expect("init containers");
    let names: Vec<&str> = init.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["turnlock-init", "turnlock"], "rules first, then the sidecar");
    let args = init[0].args.clone().expect("args");
    assert_eq!(args[0], "init-iptables");
    assert!(args.windows(2).any(|w| w == ["--store-ports", "8080"]));
    assert!(args.windows(2).any(|w| w == ["--proxy-uid", "1337"]));
    let caps = init[0]
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .and_then(|c| c.add.clone())
        .expect("capabilities");
    assert!(caps.contains(&"NET_ADMIN".to_owned()));
    let sidecar_uid = init[1].security_context.as_ref().and_then(|s| s.run_as_user);
    assert_eq!(sidecar_uid, Some(1337), "the uid the rules exclude");
    assert_eq!(env_of(&init[1], "TURNLOCK_TRANSPARENT"), Some("true"));
    assert_eq!(
        env_of(&spec.containers[0], "CONTEXT_STORE_URL"),
        Some("http://context-store.agents.svc:8080"),
        "the agent's configuration is untouched"
    );
}

#[tokio::test]
async fn a_bad_annotation_refuses_the_pod_with_the_reason() {
    let hook = Webhook::start(|_| {}).await;
    let original = pod(json!({a::INJECT: "true", a::LOCK_BUDGET_MS: "fast"}));
    let response = hook.review("/inject", &pod_review(original)).await;
    assert_eq!(response["allowed"], false, "{response}");
    assert_eq!(response["status"]["code"], 400);
    let message = response["status"]["message"].as_str().expect("message");
    assert!(message.contains(a::LOCK_BUDGET_MS), "{message}");
    assert!(response.get("patch").is_none());
}

#[tokio::test]
async fn objects_other_than_new_pods_are_admitted_unchanged() {
    let hook = Webhook::start(|_| {}).await;
    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "agent", "namespace": "agents", "annotations": {a::INJECT: "true"}},
        "spec": {"selector": {"matchLabels": {"app": "agent"}}, "template": {"metadata": {"labels": {"app": "agent"}}, "spec": {"containers": [{"name": "agent", "image": "agent"}]}}}
    });
    let response = hook
        .review(
            "/inject",
            &review_of(deployment, ("apps", "v1", "Deployment"), "deployments"),
        )
        .await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none(), "{response}");

    let config_map = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {}});
    let response = hook
        .review("/inject", &review_of(config_map, ("", "v1", "ConfigMap"), "configmaps"))
        .await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none());

    let mut update = pod_review(pod(json!({a::INJECT: "true"})));
    update["request"]["operation"] = json!("UPDATE");
    let response = hook.review("/inject", &update).await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none(), "only creation is mutated: {response}");
}

#[tokio::test]
async fn malformed_reviews_get_400() {
    let hook = Webhook::start(|_| {}).await;
    let cases: Vec<Vec<u8>> = vec![
        b"not json".to_vec(),
        b"".to_vec(),
        serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "1", "kind": {"group": "", "version": "v1", "kind": "Pod"}}})).expect("json"),
        serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"})).expect("json"),
        serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"kind": {"kind": "Pod"}}})).expect("json"),
        serde_json::to_vec(&json!([1, 2, 3])).expect("json"),
    ];
    for body in cases {
        let shown = String::from_utf8_lossy(&body).into_owned();
        let (status, json) = hook.send(http::Method::POST, "/inject", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{shown}: {json}");
        assert_eq!(json["error"], "invalid_review", "{shown}");
    }
    // A pod object that is not a valid Pod is refused in the review, not with a crash.
    let mut broken = pod(json!({a::INJECT: "true"}));
    broken["spec"]["containers"] = json!("not a list");
    let response = hook.review("/inject", &pod_review(broken)).await;
    assert_eq!(response["allowed"], false, "{response}");
}

#[tokio::test]
async fn health_endpoint_answers_over_https_only() {
    let hook = Webhook::start(|_| {}).await;
    let (status, body) = hook.send(http::Method::GET, "/healthz", Vec::new()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["status"], "ok");
    let (status, _) = hook.send(http::Method::GET, "/nope", Vec::new()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // Plain HTTP on the webhook port gets no HTTP answer.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = TcpStream::connect(hook.running.addr).await.expect("connect");
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_to_end(&mut buf)).await;
    assert!(!buf.starts_with(b"HTTP/1.1 200"), "served plain HTTP");
}

#[tokio::test]
async fn reviews_are_answered_over_http2_as_the_api_server_prefers() {
    let hook = Webhook::start(|_| {}).await;
    let mut roots = rustls::RootCertStore::empty();
    let generated_ca = std::fs::read(hook.dir.path().join("ca.crt")).expect("ca");
    roots
        .add(CertificateDer::from_pem_slice(&generated_ca).expect("CA pem"))
        .expect("CA added");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(hook.running.addr).await.expect("connect");
    let name = ServerName::try_from(SERVICE_DNS).expect("server name");
    let tls = TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .expect("TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "h2 negotiated");
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let original = pod(json!({a::INJECT: "true"}));
    let review = pod_review(original.clone());
    let req = Request::builder()
        .method(http::Method::POST)
        .uri(format!("https://{SERVICE_DNS}/inject"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(&review).expect("json"))))
        .expect("request");
    let res = sender.send_request(req).await.expect("response");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.version(), http::Version::HTTP_2);
    let body: Value = serde_json::from_slice(&res.into_body().collect().await.expect("body").to_bytes()).expect("json");
    assert_valid_pod(&apply(&original, &body["response"]));
}

#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart() {
    let hook = Webhook::start(|a| a.tls_reload_secs = 1).await;
    assert!(hook.handshake_ok(&hook.connector).await);
    let names = certs::service_names("turnlock-injector", "turnlock-system");
    let renewed = certs::generate(&names, 1).expect("certificates");
    let new_client = trusting(&renewed.ca_cert);
    assert!(
        !hook.handshake_ok(&new_client).await,
        "a client of the new CA cannot trust the old certificate"
    );
    // Written the way a Secret volume update lands: key and certificate replaced.
    std::fs::write(hook.dir.path().join("tls.key"), &renewed.key).expect("write key");
    std::fs::write(hook.dir.path().join("tls.crt"), &renewed.cert).expect("write cert");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !hook.handshake_ok(&new_client).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the renewed certificate was never served"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(
        !hook.handshake_ok(&hook.connector).await,
        "the old certificate is no longer served"
    );
}

#[test]
fn certs_command_writes_a_chain_that_verifies_for_the_service() {
    let dir = tempfile::tempdir().expect("tempdir");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_turnlock"))
        .args(["inject", "certs", "--out-dir"])
        .arg(dir.path())
        .args(["--service", "hook", "--namespace", "ns"])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run turnlock");
    assert!(status.success());
    let read = |n: &str| std::fs::read(dir.path().join(n)).expect(n);
    let ca = CertificateDer::from_pem_slice(&read("ca.crt")).expect("ca");
    let leaf = CertificateDer::from_pem_slice(&read("tls.crt")).expect("leaf");
    let _key = rustls_pki_types::PrivateKeyDer::from_pem_slice(&read("tls.key")).expect("key");
    use rustls::client::danger::ServerCertVerifier;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).expect("root");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .expect("verifier");
    let now = rustls_pki_types::UnixTime::now();
    for name in ["hook.ns.svc", "hook.ns.svc.cluster.local"] {
        verifier
            .verify_server_cert(&leaf, &[], &ServerName::try_from(name).expect("name"), &[], now)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert!(verifier
        .verify_server_cert(
            &leaf,
            &[],
            &ServerName::try_from("other.ns.svc").expect("name"),
            &[],
            now
        )
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_shutdown_the_webhook_drains_answering_reviews_while_not_ready() {
    let hook = Webhook::start(|a| a.drain_ms = 1500).await;
    let review = pod_review(pod(json!({a::INJECT: "true"})));
    assert!(hook.review("/inject", &review).await["patch"].is_string());
    hook.running.shutdown_token().cancel();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let (status, _) = hook.send(http::Method::GET, "/readyz", Vec::new()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "ready while draining");
    assert!(
        hook.review("/inject", &review).await["patch"].is_string(),
        "a review during the drain was not answered"
    );
    let (status, _) = hook.send(http::Method::GET, "/metrics", Vec::new()).await;
    assert_eq!(status, StatusCode::OK);
    tokio::time::sleep(std::time::Duration::from_millis(1800)).await;
    assert!(
        TcpStream::connect(hook.running.addr).await.is_err(),
        "still accepting after the drain"
    );
}

#[tokio::test]
async fn the_webhook_counts_reviews_by_outcome() {
    let hook = Webhook::start(|_| {}).await;
    hook.review("/inject", &pod_review(pod(json!({a::INJECT: "true"}))))
        .await;
    hook.review("/inject", &pod_review(pod(json!({})))).await;
    let tcp = TcpStream::connect(hook.running.addr).await.expect("connect");
    let name = ServerName::try_from(SERVICE_DNS).expect("server name");
    let tls = hook.connector.connect(name, tcp).await.expect("TLS handshake");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("HTTP handshake");
    tokio::spawn(conn);
    let req = Request::builder()
        .uri("/metrics")
        .header(http::header::HOST, SERVICE_DNS)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let res = sender.send_request(req).await.expect("response");
    let text = String::from_utf8_lossy(&res.into_body().collect().await.expect("body").to_bytes()).into_owned();
    assert!(
        text.contains(r#"turnlock_injector_reviews_total{outcome="injected"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"turnlock_injector_reviews_total{outcome="unchanged"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn redis_tls_and_acl_secrets_are_mounted_read_only_into_the_sidecar() {
    let hook = Webhook::start(|_| {}).await;
    let original = pod(json!({
        a::INJECT: "true",
        a::REDIS_URL: "rediss://10.0.0.5:6380",
        a::REDIS_CA_SECRET: "redis-ca",
        a::REDIS_CLIENT_CERT_SECRET: "redis-client",
        a::REDIS_PASSWORD_SECRET: "redis-acl/password",
        a::REDIS_USERNAME: "turnlock",
        a::REDIS_TLS_SERVER_NAME: "redis.internal",
    }));
    let response = hook.review("/inject", &pod_review(original.clone())).await;
    let typed = assert_valid_pod(&apply(&original, &response));
    let spec = typed.spec.expect("spec");
    let sidecar = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find(|c| c.name == "turnlock")
        .expect("sidecar");
    for (name, value) in [
        ("TURNLOCK_REDIS", "rediss://10.0.0.5:6380"),
        ("TURNLOCK_REDIS_CA", "/var/run/turnlock/redis-ca/ca.crt"),
        ("TURNLOCK_REDIS_CERT", "/var/run/turnlock/redis-client/tls.crt"),
        ("TURNLOCK_REDIS_KEY", "/var/run/turnlock/redis-client/tls.key"),
        (
            "TURNLOCK_REDIS_PASSWORD_FILE",
            "/var/run/turnlock/redis-password/password",
        ),
        ("TURNLOCK_REDIS_USERNAME", "turnlock"),
        ("TURNLOCK_REDIS_TLS_SERVER_NAME", "redis.internal"),
    ] {
        assert_eq!(env_of(sidecar, name), Some(value), "{name}");
    }
    let mounts = sidecar.volume_mounts.clone().expect("mounts");
    assert_eq!(mounts.len(), 3);
    assert!(
        mounts.iter().all(|m| m.read_only == Some(true) && m.sub_path.is_none()),
        "whole Secrets, read-only (a subPath mount would never see a rotation): {mounts:?}"
    );
    let volumes = spec.volumes.expect("volumes");
    let secrets: Vec<(String, String)> = volumes
        .iter()
        .filter_map(|v| Some((v.name.clone(), v.secret.as_ref()?.secret_name.clone()?)))
        .collect();
    for (volume, secret) in [
        ("turnlock-redis-ca", "redis-ca"),
        ("turnlock-redis-client", "redis-client"),
        ("turnlock-redis-password", "redis-acl"),
    ] {
        assert!(
            secrets.contains(&(volume.to_owned(), secret.to_owned())),
            "{volume}: {secrets:?}"
        );
    }
    // The agent's containers do not see them.
    let agent = &spec.containers[0];
    assert!(agent
        .volume_mounts
        .iter()
        .flatten()
        .all(|m| !m.name.starts_with("turnlock-redis")));

    // A CA Secret with a plaintext URL would give a sidecar that refuses to start: refused.
    let refused = pod(json!({
        a::INJECT: "true",
        a::REDIS_URL: "redis://10.0.0.5:6379",
        a::REDIS_CA_SECRET: "redis-ca",
    }));
    let response = hook.review("/inject", &pod_review(refused)).await;
    assert_eq!(response["allowed"], false, "{response}");
    let message = response["status"]["message"].as_str().expect("message");
    assert!(message.contains("rediss://"), "{message}");
}
