//! The change a write body asks for, per route kind: its [`Op`], or the refusal that says what
//! to fix in the body.

use serde_json::{Map, Value};

use super::{bad, Refusal};
use crate::http::version_from_etag;
use crate::merge::{validate_messages, Op, COMPACTED_IDS, LIFE};
use crate::proxy::error::EdgeError;
use crate::routes::Kind;

pub(super) fn build_op(
    kind: Kind,
    mut doc: Map<String, Value>,
    replace: bool,
    if_match: Option<&http::HeaderValue>,
    turn_field: Option<&str>,
) -> Result<Op, Refusal> {
    let if_match = match if_match {
        None => None,
        Some(v) => Some(parse_if_match(v)?),
    };
    Ok(match kind {
        Kind::Append => {
            if let Some(id) = duplicate_id(&doc) {
                return Err(bad(
                    "invalid_messages",
                    format!("message id {id:?} appears more than once in `messages`"),
                ));
            }
            let messages = doc.remove("messages").ok_or_else(|| {
                bad(
                    "invalid_messages",
                    "an append needs `messages`: an array of message objects",
                )
            })?;
            Op::Append {
                messages: validate_messages(&messages).map_err(|m| bad("invalid_messages", m))?,
            }
        }
        Kind::Patch => {
            if let Some(field) = ["messages", "session", "version", COMPACTED_IDS, LIFE]
                .into_iter()
                .find(|f| doc.contains_key(*f))
            {
                let how = match field {
                    "messages" => "append messages with POST …/messages",
                    _ => "turnlock maintains it",
                };
                return Err(bad("forbidden_field", format!("a patch cannot set `{field}`: {how}")));
            }
            Op::Patch { patch: doc }
        }
        Kind::Put if replace => {
            let if_match = match if_match {
                None => {
                    return Err(EdgeError::PreconditionRequired(
                        "a replacement (X-Context-Replace: true) needs If-Match with the version read",
                    )
                    .into())
                }
                Some(IfMatch::Weak(_)) => return Err(EdgeError::WeakIfMatch.into()),
                Some(IfMatch::Any) => None,
                Some(IfMatch::Strong(v)) => Some(v),
            };
            check_messages_field(&doc)?;
            Op::Replace { doc, if_match }
        }
        Kind::Put => {
            check_messages_field(&doc)?;
            let body_version = match doc.get("version") {
                None => None,
                Some(v) => Some(
                    v.as_u64()
                        .ok_or_else(|| bad("invalid_version", "`version` must be a non-negative integer"))?,
                ),
            };
            let header_version = match if_match {
                Some(IfMatch::Strong(v)) => Some(v),
                Some(IfMatch::Weak(_)) => return Err(EdgeError::WeakIfMatch.into()),
                // `*` asks for a document that exists, but names no version to merge against:
                // a merged PUT of a stored session needs the version read, and `*` never
                // creates one (RFC 9110: false when there is no current representation).
                Some(IfMatch::Any) if body_version.is_none() => {
                    return Err(EdgeError::PreconditionRequired(
                        "If-Match: * names no version: a merged PUT needs the version read (in `version` or If-Match), and never creates a session under `*`",
                    )
                    .into())
                }
                // Version 0 is no stored document: `*` asks for one.
                Some(IfMatch::Any) if body_version == Some(0) => {
                    return Err(EdgeError::AnyButAbsent.into())
                }
                Some(IfMatch::Any) | None => None,
            };
            if let Some(id) = duplicate_id(&doc) {
                return Err(bad(
                    "invalid_messages",
                    format!("message id {id:?} appears more than once in `messages`"),
                ));
            }
            let base_version = match (body_version, header_version) {
                (Some(b), Some(h)) if b != h => {
                    return Err(bad(
                        "versions_disagree",
                        format!("body version {b} and If-Match {h} disagree; send the version read in both"),
                    ))
                }
                (Some(v), _) | (None, Some(v)) => Some(v),
                // Only a new session is created without one (else 428, under the lock).
                (None, None) => None,
            };
            Op::Put { doc, base_version }
        }
        Kind::Delete => return Err(bad("invalid_route", "a delete carries no body to merge")),
        Kind::Compact => {
            let through = match doc.remove("through") {
                Some(Value::String(s)) if !s.is_empty() => s,
                _ => {
                    return Err(bad(
                        "invalid_through",
                        "a compaction needs `through`: the id of the last message it summarizes",
                    ))
                }
            };
            let summary = doc.remove("summary");
            if let Some(field) = doc.keys().find(|k| Some(k.as_str()) != turn_field) {
                return Err(bad(
                    "unknown_field",
                    format!("a compaction takes `turn`, `through` and `summary`, not `{field}`"),
                ));
            }
            Op::Compact { through, summary }
        }
    })
}

/// The first message id that appears twice in a document's `messages`, if any.
fn duplicate_id(doc: &Map<String, Value>) -> Option<String> {
    let mut seen = std::collections::HashSet::new();
    doc.get("messages")?
        .as_array()?
        .iter()
        .filter_map(|m| m.get("id")?.as_str())
        .find(|id| !seen.insert(*id))
        .map(str::to_owned)
}

/// An `If-Match` value: `*`, a strong or a weak entity tag holding a version.
#[derive(Clone, Copy, Debug, PartialEq)]
enum IfMatch {
    Any,
    Strong(u64),
    Weak(u64),
}

fn parse_if_match(v: &http::HeaderValue) -> Result<IfMatch, Refusal> {
    let invalid = || bad("invalid_if_match", "If-Match must hold the version read, e.g. \"12\"");
    let raw = v.to_str().map_err(|_| invalid())?.trim();
    if raw == "*" {
        return Ok(IfMatch::Any);
    }
    let version = version_from_etag(raw).ok_or_else(invalid)?;
    Ok(if raw.starts_with("W/") {
        IfMatch::Weak(version)
    } else {
        IfMatch::Strong(version)
    })
}

fn check_messages_field(doc: &Map<String, Value>) -> Result<(), Refusal> {
    match doc.get("messages") {
        None => Ok(()),
        Some(m) => validate_messages(m).map(|_| ()).map_err(|e| bad("invalid_messages", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn if_match_is_star_strong_or_weak() {
        let parse = |v: &'static str| parse_if_match(&http::HeaderValue::from_static(v)).ok();
        assert_eq!(parse("*"), Some(IfMatch::Any));
        assert_eq!(parse("\"3\""), Some(IfMatch::Strong(3)));
        assert_eq!(parse("W/\"3\""), Some(IfMatch::Weak(3)));
        assert_eq!(parse("\"abc\""), None);
    }
}
