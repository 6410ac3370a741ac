//! Property-based fuzzing (bounded in cases) of the request edge, turn extraction and the
//! merge rules: arbitrary input never panics, and what is accepted obeys the rules.
//! `PROPTEST_CASES` raises the number of cases for a longer run.

use std::collections::HashSet;
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use turnlock::merge::{self, IdSource, MergeError, Op};
use turnlock::session::{self, Keys, SessionId, MAX_TURN};

fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig::with_cases(n)
}

/// Arbitrary JSON, nested a little.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f)
            .map(Value::Number)
            .unwrap_or(Value::Null)),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z]{1,6}", inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(cases(2000))]

    #[test]
    fn session_ids_are_either_refused_or_safe_in_keys(raw in ".{0,140}", other in "[A-Za-z0-9._-]{1,20}") {
        if let Ok(id) = SessionId::parse(&raw) {
            prop_assert!(id.as_str().len() <= session::MAX_SESSION_ID_LEN);
            prop_assert!(id.as_str().chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')));
            prop_assert!(id.as_str() != "." && id.as_str() != "..");
            let keys = Keys::new("p:");
            if let Ok(o) = SessionId::parse(&other) {
                if o != id {
                    prop_assert_ne!(keys.lock(&id, 1), keys.lock(&o, 1));
                    prop_assert_ne!(keys.fence_token(&id), keys.fence_token(&o));
                }
            }
        }
    }

    #[test]
    fn turns_from_json_are_exact_non_negative_integers(v in any_json()) {
        match session::turn_from_json(&v) {
            Ok(t) => {
                prop_assert!(t <= MAX_TURN);
                prop_assert_eq!(v.as_u64(), Some(t));
            }
            Err(e) => {
                prop_assert!(v.as_u64().is_none_or(|t| t > MAX_TURN));
                prop_assert_eq!(e.code(), "invalid_turn");
            }
        }
    }

    #[test]
    fn turns_from_headers_are_digits_within_range(raw in prop::collection::vec(any::<u8>(), 0..30)) {
        let expected = std::str::from_utf8(&raw)
            .ok()
            .map(str::trim)
            .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|t| t.parse::<u64>().ok())
            .filter(|&t| t <= MAX_TURN);
        prop_assert_eq!(session::turn_from_header(&raw).ok(), expected);
    }

    #[test]
    fn turns_from_digit_headers_round_trip(t in 0..=MAX_TURN, pad in " {0,2}") {
        prop_assert_eq!(session::turn_from_header(format!("{pad}{t}{pad}").as_bytes()), Ok(t));
    }
}

/// Deterministic message ids for the merge properties.
struct Counter(u64);

impl IdSource for Counter {
    fn next_id(&mut self) -> String {
        self.0 += 1;
        format!("gen-{}", self.0)
    }
}

#[derive(Clone, Debug)]
enum Step {
    Append {
        ids: Vec<Option<u8>>,
    },
    Patch {
        field: String,
        value: Value,
    },
    Compact {
        through: u8,
    },
    Put {
        ids: Vec<u8>,
        field: String,
        value: Value,
        stale_base: bool,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let field = prop_oneof![
        Just("state".to_owned()),
        Just("title".to_owned()),
        Just("meta".to_owned())
    ];
    prop_oneof![
        4 => prop::collection::vec(prop::option::of(0u8..24), 0..4).prop_map(|ids| Step::Append { ids }),
        2 => (field.clone(), any_json()).prop_map(|(field, value)| Step::Patch { field, value }),
        1 => (0u8..24).prop_map(|through| Step::Compact { through }),
        2 => (prop::collection::vec(0u8..24, 0..4), field, any_json(), any::<bool>())
            .prop_map(|(ids, field, value, stale_base)| Step::Put { ids, field, value, stale_base }),
    ]
}

fn msg(id: Option<u8>) -> Value {
    match id {
        Some(i) => json!({"id": format!("m-{i}"), "content": i}),
        None => json!({"content": "no id"}),
    }
}

fn ids_of(doc: &merge::Document) -> Vec<String> {
    merge::messages_of(doc).iter().filter_map(merge::message_id).collect()
}

proptest! {
    #![proptest_config(cases(500))]

    /// Any sequence of writes at any turns: the version grows by one per accepted write, the
    /// turn never moves backwards, stale writes are refused, ids stay unique, appended messages
    /// are stored, and fields a write does not touch keep their values.
    #[test]
    fn merge_rules_hold_for_any_sequence_of_writes(steps in prop::collection::vec((step(), 0u64..6), 1..24)) {
        let session = SessionId::parse("prop").expect("valid id");
        let mut ids = Counter(0);
        let mut doc: Option<merge::Document> = None;
        let mut removed: HashSet<String> = HashSet::new();
        for (step, turn) in steps {
            let stored_turn = doc.as_ref().map(merge::turn_of).unwrap_or(0);
            let stored_version = doc.as_ref().map(merge::version_of).unwrap_or(0);
            let op = match &step {
                Step::Append { ids } => Op::Append { messages: ids.iter().map(|i| msg(*i)).collect() },
                Step::Patch { field, value } => {
                    let mut patch = Map::new();
                    patch.insert(field.clone(), value.clone());
                    Op::Patch { patch }
                }
                Step::Compact { through } => Op::Compact { through: format!("m-{through}"), summary: Some(json!("s")) },
                Step::Put { ids, field, value, stale_base } => {
                    let mut d = doc.clone().unwrap_or_default();
                    d.insert(field.clone(), value.clone());
                    let mut messages: Vec<Value> = merge::messages_of(&d).to_vec();
                    messages.extend(ids.iter().map(|i| msg(Some(*i))));
                    d.insert("messages".into(), Value::Array(messages));
                    let base = if *stale_base { stored_version.saturating_sub(1) } else { stored_version };
                    Op::Put { doc: d, base_version: Some(base) }
                }
            };
            let result = merge::apply(&session, doc.as_ref(), turn, &op, None, &mut ids);
            match result {
                Err(MergeError::StaleTurn { current, .. }) => {
                    prop_assert!(turn < stored_turn);
                    prop_assert_eq!(current, stored_turn);
                }
                Err(e) => {
                    prop_assert!(turn >= stored_turn || doc.is_none(), "{e}");
                }
                Ok((next, applied)) => {
                    prop_assert!(doc.is_none() || turn >= stored_turn);
                    prop_assert_eq!(merge::version_of(&next), stored_version + 1);
                    prop_assert_eq!(merge::turn_of(&next), stored_turn.max(turn));
                    let now = ids_of(&next);
                    let unique: HashSet<&String> = now.iter().collect();
                    prop_assert_eq!(unique.len(), now.len(), "duplicate ids: {:?}", now);
                    // Every id answered is stored, or was compacted (and is kept out).
                    for id in &applied.message_ids {
                        prop_assert!(now.contains(id) || removed.contains(id), "applied {id} is not stored");
                    }
                    let before: Vec<String> = doc.as_ref().map(ids_of).unwrap_or_default();
                    match &step {
                        Step::Append { .. } | Step::Patch { .. } => {
                            // Nothing stored is dropped, and untouched fields keep their values.
                            for id in &before {
                                prop_assert!(now.contains(id), "{id} was dropped");
                            }
                            if let (Some(prev), Step::Append { .. }) = (&doc, &step) {
                                for (k, v) in prev.iter().filter(|(k, _)| !["messages", "turn", "version"].contains(&k.as_str())) {
                                    prop_assert_eq!(next.get(k), Some(v));
                                }
                            }
                        }
                        Step::Compact { through } => {
                            let through = format!("m-{through}");
                            match before.iter().position(|i| *i == through) {
                                Some(pos) => {
                                    removed.extend(before[..=pos].iter().cloned());
                                    prop_assert_eq!(&now[..], &before[pos + 1..]);
                                }
                                // The same compaction again: a no-op.
                                None => {
                                    prop_assert!(removed.contains(&through), "compacted through {through}, never stored");
                                    prop_assert_eq!(&now, &before);
                                }
                            }
                        }
                        Step::Put { .. } => {
                            for id in &before {
                                prop_assert!(now.contains(id), "{id} acknowledged earlier was dropped by a merged PUT");
                            }
                        }
                    }
                    doc = Some(next);
                }
            }
        }
        let _ = removed;
    }
}

/// The request edge over real HTTP: arbitrary bodies, content types, turn headers and session
/// ids never get a 5xx from a healthy proxy, and every refusal is a JSON error with a code.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fn edge() -> &'static (std::net::SocketAddr, turnlock::client::JsonClient) {
    static EDGE: OnceLock<(std::net::SocketAddr, turnlock::client::JsonClient)> = OnceLock::new();
    EDGE.get_or_init(|| {
        runtime().block_on(async {
            let store = crate::support::store().await;
            let addr = store.addr;
            std::mem::forget(store);
            let p = crate::support::proxy(crate::support::proxy_args(addr, None)).await;
            let c = crate::support::client(p.addr);
            let a = p.addr;
            std::mem::forget(p);
            (a, c)
        })
    })
}

fn body_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        any_json().prop_map(|v| serde_json::to_vec(&v).unwrap_or_default()),
        (any_json(), any_json())
            .prop_map(|(t, m)| serde_json::to_vec(&json!({"turn": t, "messages": m})).unwrap_or_default()),
        (0u64..4, prop::collection::vec(any_json(), 0..3))
            .prop_map(|(t, m)| serde_json::to_vec(&json!({"turn": t, "messages": m})).unwrap_or_default()),
    ]
}

proptest! {
    #![proptest_config(cases(300))]

    #[test]
    fn the_request_edge_answers_any_input_with_a_clear_status(
        id in prop_oneof!["[A-Za-z0-9._-]{1,8}", "[ -~]{0,10}"],
        route in 0usize..4,
        content_type in prop_oneof![Just("application/json"), Just("application/merge-patch+json"), Just("text/plain"), Just("")],
        turn_header in prop::option::of("[ -~]{0,8}"),
        body in body_strategy(),
    ) {
        let (addr, _) = edge();
        // Anything outside the unreserved characters travels percent-encoded, as a client sends it.
        let id: String = id
            .bytes()
            .map(|b| if b.is_ascii_alphanumeric() || b"._-".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
            .collect();
        let (method, path) = match route {
            0 => ("POST", format!("/v1/sessions/{id}/messages")),
            1 => ("PATCH", format!("/v1/sessions/{id}")),
            2 => ("PUT", format!("/v1/sessions/{id}")),
            _ => ("POST", format!("/v1/sessions/{id}/compact")),
        };
        let status = runtime().block_on(async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut req = format!("{method} {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
            if !content_type.is_empty() {
                req.push_str(&format!("content-type: {content_type}\r\n"));
            }
            if let Some(t) = &turn_header {
                req.push_str(&format!("x-session-turn: {t}\r\n"));
            }
            req.push_str("\r\n");
            let mut bytes = req.into_bytes();
            bytes.extend_from_slice(&body);
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            s.write_all(&bytes).await.expect("send");
            let mut out = Vec::new();
            let _ = tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut out)).await;
            String::from_utf8_lossy(&out).into_owned()
        });
        let code: u16 = status.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        prop_assert!(code != 0, "no answer to {method} {path}");
        prop_assert!(code < 500 || code == 503, "{method} {path} got {code}: {status}");
        if code >= 400 && code != 431 {
            let json_start = status.find("\r\n\r\n").map(|i| i + 4).unwrap_or(0);
            let body = &status[json_start..];
            let v: Value = body
                .find('{')
                .and_then(|s| body.rfind('}').map(|e| &body[s..=e]))
                .and_then(|j| serde_json::from_str(j).ok())
                .unwrap_or(Value::Null);
            prop_assert!(v["error"].is_string(), "{method} {path} {code} without a JSON error: {status}");
        }
    }
}
