//! Deciding whether a pod gets the sidecar, and building the JSON Patch that adds it (pure).
//!
//! The patch is the difference between the pod as received and the pod with the sidecar, both
//! as raw JSON: fields this version of the Kubernetes types does not know are never touched.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, Pod, Probe, ResourceRequirements,
    SeccompProfile, SecretKeySelector, SecretVolumeSource, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;

use super::annotations::{self, RedisSource, Settings};
use super::{WebhookArgs, INIT_NAME, SIDECAR_NAME};

/// How the webhook was reached: which default applies to pods without the inject annotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Only pods annotated (or labelled) `turnlock.dev/inject: "true"`.
    OptIn,
    /// The namespace is labelled `turnlock.dev/inject: enabled`: every pod, unless it opts out.
    Namespace,
}

/// What the webhook answers for one pod.
#[derive(Debug)]
pub enum Outcome {
    /// Admit unchanged, saying why.
    Unchanged(&'static str),
    /// Admit with this patch; the warnings are shown to whoever created the pod.
    Patch {
        patch: json_patch::Patch,
        warnings: Vec<String>,
    },
    /// Refuse the pod (a misconfigured annotation), with the reason.
    Refuse(String),
}

/// Decides and builds the patch for `pod` (the raw `request.object`).
pub fn inject(pod: &Value, scope: Scope, defaults: &WebhookArgs) -> Outcome {
    let typed: Pod = match serde_json::from_value(pod.clone()) {
        Ok(p) => p,
        Err(e) => return Outcome::Refuse(format!("the object is not a valid Pod: {e}")),
    };
    let empty = BTreeMap::new();
    let annotations = typed.metadata.annotations.as_ref().unwrap_or(&empty);
    let labels = typed.metadata.labels.as_ref().unwrap_or(&empty);
    match annotations::wants_injection(annotations, labels, scope == Scope::Namespace) {
        Ok(true) => {}
        Ok(false) => return Outcome::Unchanged("the pod is not opted in to turnlock injection"),
        Err(e) => return Outcome::Refuse(e.to_string()),
    }
    let Some(spec) = &typed.spec else {
        return Outcome::Unchanged("the pod has no spec");
    };
    let init = spec.init_containers.as_deref().unwrap_or_default();
    if annotations.contains_key(annotations::STATUS)
        || spec.containers.iter().chain(init).any(|c| c.name == SIDECAR_NAME)
    {
        return Outcome::Unchanged("the pod already has the turnlock sidecar");
    }
    if spec.host_network == Some(true) {
        return Outcome::Unchanged("host-network pods are not injected");
    }
    let settings = match annotations::resolve(annotations, defaults) {
        Ok(s) => s,
        Err(e) => return Outcome::Refuse(e.to_string()),
    };
    let targets: Vec<String> = match &settings.containers {
        Some(names) => {
            if let Some(missing) = names.iter().find(|n| !spec.containers.iter().any(|c| &&c.name == n)) {
                return Outcome::Refuse(format!(
                    "annotation {}: the pod has no container {missing:?}",
                    annotations::CONTAINERS
                ));
            }
            names.clone()
        }
        None => spec.containers.iter().map(|c| c.name.clone()).collect(),
    };

    let mut warnings = Vec::new();
    if settings.redis == RedisSource::None {
        warnings.push(
            "turnlock: no Redis configured; the sidecar's in-memory lock does not serialize writers in other pods"
                .to_owned(),
        );
    }
    if settings.transparent.is_none() && settings.store_url_env.is_none() {
        warnings.push(format!(
            "turnlock: no {} annotation; point the agent's store URL at http://127.0.0.1:{} yourself",
            annotations::STORE_URL_ENV,
            defaults.proxy_port
        ));
    }

    let mut patched = pod.clone();
    if let Err(e) = mutate(&mut patched, &settings, &targets, defaults) {
        return Outcome::Refuse(e);
    }
    Outcome::Patch {
        patch: json_patch::diff(pod, &patched),
        warnings,
    }
}

/// Adds the containers, the agent's env var and the status annotation to the raw pod.
fn mutate(pod: &mut Value, settings: &Settings, targets: &[String], defaults: &WebhookArgs) -> Result<(), String> {
    let sidecar = to_value(sidecar(settings, defaults))?;
    let init = match &settings.transparent {
        Some(ports) => Some(to_value(init_container(ports, defaults))?),
        None => None,
    };

    let volumes = redis_volumes(settings)
        .into_iter()
        .map(|v| serde_json::to_value(v).map_err(|e| format!("cannot encode a volume: {e}")))
        .collect::<Result<Vec<_>, _>>()?;

    let root = pod.as_object_mut().ok_or("the pod is not a JSON object")?;
    let metadata = object_field(root, "metadata")?;
    let annotations = object_field(metadata, "annotations")?;
    annotations.insert(annotations::STATUS.to_owned(), Value::String(status(settings)));

    let spec = object_field(root, "spec")?;
    if !volumes.is_empty() {
        let pod_volumes = array_field(spec, "volumes")?;
        for v in volumes {
            let name = v.get("name").cloned();
            if pod_volumes.iter().any(|p| p.get("name") == name.as_ref()) {
                return Err(format!(
                    "the pod already has a volume named {}",
                    name.unwrap_or_default()
                ));
            }
            pod_volumes.push(v);
        }
    }
    let mut prepend = Vec::new();
    prepend.extend(init);
    if settings.native {
        prepend.push(sidecar.clone());
    }
    if !prepend.is_empty() {
        let init_containers = array_field(spec, "initContainers")?;
        for (i, c) in prepend.into_iter().enumerate() {
            init_containers.insert(i, c);
        }
    }
    let containers = array_field(spec, "containers")?;
    if settings.transparent.is_none() {
        if let Some(env_name) = &settings.store_url_env {
            let url = format!("http://127.0.0.1:{}", defaults.proxy_port);
            for c in containers.iter_mut() {
                let name = c.get("name").and_then(Value::as_str).unwrap_or_default();
                if targets.iter().any(|t| t == name) {
                    if let Some(obj) = c.as_object_mut() {
                        set_env(obj, env_name, &url)?;
                    }
                }
            }
        }
    }
    if !settings.native {
        containers.push(sidecar);
    }
    Ok(())
}

fn status(settings: &Settings) -> String {
    serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "native": settings.native,
        "transparent": settings.transparent.is_some(),
    })
    .to_string()
}

/// The sidecar container.
pub fn sidecar(settings: &Settings, defaults: &WebhookArgs) -> Container {
    let mut env = vec![
        env_var("TURNLOCK_LISTEN", &format!("127.0.0.1:{}", defaults.proxy_port)),
        // The kubelet probes the pod IP: the admin server (read-only endpoints) listens on all
        // interfaces.
        env_var("TURNLOCK_ADMIN", &format!("0.0.0.0:{}", defaults.admin_port)),
        // Prometheus scrapes the pod IP too.
        env_var("TURNLOCK_ADMIN_PUBLIC_METRICS", "true"),
        env_var("RUST_LOG", &settings.log_level),
    ];
    if let Some(u) = &settings.upstream {
        env.push(env_var("TURNLOCK_UPSTREAM", u));
    }
    match &settings.redis {
        RedisSource::None => {}
        RedisSource::Url(u) => env.push(env_var("TURNLOCK_REDIS", u)),
        RedisSource::Secret { name, key } => env.push(EnvVar {
            name: "TURNLOCK_REDIS".into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: name.clone(),
                    key: key.clone(),
                    optional: Some(false),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
    env.extend(redis_access_env(settings));
    if let Some(ms) = settings.lock_budget_ms {
        env.push(env_var("TURNLOCK_LOCK_BUDGET_MS", &ms.to_string()));
    }
    if let Some(ms) = settings.wait_deadline_ms {
        env.push(env_var("TURNLOCK_WAIT_DEADLINE_MS", &ms.to_string()));
    }
    if settings.transparent.is_some() {
        env.push(env_var("TURNLOCK_TRANSPARENT", "true"));
    }
    let probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(i32::from(defaults.admin_port)),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(2),
        ..Default::default()
    };
    let r = &settings.resources;
    Container {
        name: SIDECAR_NAME.into(),
        image: Some(defaults.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        args: Some(vec!["proxy".into()]),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some("turnlock-admin".into()),
            container_port: i32::from(defaults.admin_port),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        // A native sidecar (init container restarted always) starts before the agent and
        // stops after it; its startup probe holds the agent back until the sidecar listens.
        // `/readyz` never asks Redis or the store: a dependency outage neither holds new pods
        // back, nor restarts them, nor takes running ones out of their Service (it shows in
        // `/status` and the metrics instead).
        restart_policy: settings.native.then(|| "Always".to_owned()),
        startup_probe: Some(probe("/readyz", 1, 120)),
        readiness_probe: Some(probe("/readyz", 5, 3)),
        liveness_probe: Some(probe("/healthz", 10, 3)),
        volume_mounts: Some(redis_mounts(settings)).filter(|m| !m.is_empty()),
        resources: Some(ResourceRequirements {
            requests: Some(quantities(&r.cpu_request, &r.memory_request)),
            limits: Some(quantities(&r.cpu_limit, &r.memory_limit)),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(defaults.proxy_uid),
            run_as_group: Some(defaults.proxy_uid),
            read_only_root_filesystem: Some(true),
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Where the Redis Secrets are mounted in the sidecar: whole Secrets (no `subPath`), so the
/// kubelet's updates reach the files and the sidecar reloads them.
const REDIS_CA_DIR: &str = "/var/run/turnlock/redis-ca";
const REDIS_CLIENT_DIR: &str = "/var/run/turnlock/redis-client";
const REDIS_PASSWORD_DIR: &str = "/var/run/turnlock/redis-password";

/// The Redis Secrets as (volume name, Secret, mount path).
fn redis_secrets(settings: &Settings) -> Vec<(&'static str, String, &'static str)> {
    let a = &settings.redis_access;
    let mut out = Vec::new();
    if let Some((name, _)) = &a.ca {
        out.push(("turnlock-redis-ca", name.clone(), REDIS_CA_DIR));
    }
    if let Some(name) = &a.client_cert {
        out.push(("turnlock-redis-client", name.clone(), REDIS_CLIENT_DIR));
    }
    if let Some((name, _)) = &a.password {
        out.push(("turnlock-redis-password", name.clone(), REDIS_PASSWORD_DIR));
    }
    out
}

/// The pod volumes of the Redis Secrets (mounted into the sidecar only).
pub fn redis_volumes(settings: &Settings) -> Vec<Volume> {
    redis_secrets(settings)
        .into_iter()
        .map(|(volume, secret, _)| Volume {
            name: volume.into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret),
                default_mode: Some(0o444),
                optional: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect()
}

fn redis_mounts(settings: &Settings) -> Vec<VolumeMount> {
    redis_secrets(settings)
        .into_iter()
        .map(|(volume, _, path)| VolumeMount {
            name: volume.into(),
            mount_path: path.into(),
            read_only: Some(true),
            ..Default::default()
        })
        .collect()
}

/// The sidecar's flags for the mounted Redis Secrets and the ACL user.
fn redis_access_env(settings: &Settings) -> Vec<EnvVar> {
    let a = &settings.redis_access;
    let mut env = Vec::new();
    if let Some((_, key)) = &a.ca {
        env.push(env_var("TURNLOCK_REDIS_CA", &format!("{REDIS_CA_DIR}/{key}")));
    }
    if a.client_cert.is_some() {
        env.push(env_var("TURNLOCK_REDIS_CERT", &format!("{REDIS_CLIENT_DIR}/tls.crt")));
        env.push(env_var("TURNLOCK_REDIS_KEY", &format!("{REDIS_CLIENT_DIR}/tls.key")));
    }
    if let Some((_, key)) = &a.password {
        env.push(env_var(
            "TURNLOCK_REDIS_PASSWORD_FILE",
            &format!("{REDIS_PASSWORD_DIR}/{key}"),
        ));
    }
    if let Some(user) = &a.username {
        env.push(env_var("TURNLOCK_REDIS_USERNAME", user));
    }
    if let Some(name) = &a.server_name {
        env.push(env_var("TURNLOCK_REDIS_TLS_SERVER_NAME", name));
    }
    env
}

/// The init container that installs the interception rules (transparent mode).
pub fn init_container(ports: &[u16], defaults: &WebhookArgs) -> Container {
    let ports = ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
    Container {
        name: INIT_NAME.into(),
        image: Some(defaults.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        args: Some(vec![
            "init-iptables".into(),
            "--store-ports".into(),
            ports,
            "--proxy-port".into(),
            defaults.proxy_port.to_string(),
            "--proxy-uid".into(),
            defaults.proxy_uid.to_string(),
        ]),
        resources: Some(ResourceRequirements {
            requests: Some(quantities("10m", "16Mi")),
            limits: Some(quantities("100m", "32Mi")),
            ..Default::default()
        }),
        // iptables needs root and NET_ADMIN in the pod's network namespace, nothing more.
        security_context: Some(SecurityContext {
            run_as_non_root: Some(false),
            run_as_user: Some(0),
            run_as_group: Some(0),
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            read_only_root_filesystem: Some(false),
            capabilities: Some(Capabilities {
                add: Some(vec!["NET_ADMIN".into(), "NET_RAW".into()]),
                drop: Some(vec!["ALL".into()]),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn env_var(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..Default::default()
    }
}

/// Resource quantities; an empty one is left out (no limit).
fn quantities(cpu: &str, memory: &str) -> BTreeMap<String, Quantity> {
    [("cpu", cpu), ("memory", memory)]
        .into_iter()
        .filter(|(_, q)| !q.is_empty())
        .map(|(k, q)| (k.to_owned(), Quantity(q.to_owned())))
        .collect()
}

fn to_value(c: Container) -> Result<Value, String> {
    serde_json::to_value(c).map_err(|e| format!("cannot encode the sidecar container: {e}"))
}

fn object_field<'a>(
    obj: &'a mut serde_json::Map<String, Value>,
    key: &str,
) -> Result<&'a mut serde_json::Map<String, Value>, String> {
    let v = obj.entry(key).or_insert_with(|| Value::Object(Default::default()));
    if v.is_null() {
        *v = Value::Object(Default::default());
    }
    v.as_object_mut().ok_or_else(|| format!("`{key}` is not an object"))
}

fn array_field<'a>(obj: &'a mut serde_json::Map<String, Value>, key: &str) -> Result<&'a mut Vec<Value>, String> {
    let v = obj.entry(key).or_insert_with(|| Value::Array(Vec::new()));
    if v.is_null() {
        *v = Value::Array(Vec::new());
    }
    v.as_array_mut().ok_or_else(|| format!("`{key}` is not an array"))
}

/// Sets `name=value` in a container's env, replacing an earlier definition of that name.
fn set_env(container: &mut serde_json::Map<String, Value>, name: &str, value: &str) -> Result<(), String> {
    let env = array_field(container, "env")?;
    let var = serde_json::json!({"name": name, "value": value});
    match env
        .iter_mut()
        .find(|e| e.get("name").and_then(Value::as_str) == Some(name))
    {
        Some(existing) => *existing = var,
        None => env.push(var),
    }
    Ok(())
}
