//! Patch: an RFC 7396 merge patch of the document's own fields (managed fields and `turn`
//! are left alone).

use serde_json::{Map, Value};

use super::*;

pub(super) fn apply(session: &SessionId, current: Option<&Document>, patch: &Map<String, Value>) -> Document {
    let mut doc = current.cloned().unwrap_or_else(|| empty(session));
    for (key, value) in patch {
        if MANAGED.contains(&key.as_str()) || key == "turn" {
            continue;
        }
        merge_patch_field(&mut doc, key, value);
    }
    doc
}

/// RFC 7396 for one top-level member: `null` removes, objects merge recursively, anything else
/// replaces.
fn merge_patch_field(target: &mut Map<String, Value>, key: &str, patch: &Value) {
    if patch.is_null() {
        target.remove(key);
    } else {
        json_patch::merge(target.entry(key.to_owned()).or_insert(Value::Null), patch);
    }
}
