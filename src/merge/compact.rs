//! Compact: drop the messages up to and including `through`, remembering their ids.

use serde_json::Value;

use super::*;

/// The compacted document, or `None` when this compaction was already made (its `through` is
/// among the compacted ids and the summary is the stored one).
pub(super) fn apply(
    current: Option<&Document>,
    through: &str,
    summary: Option<&Value>,
) -> Result<Option<Document>, MergeError> {
    let Some(cur) = current else {
        return Err(MergeError::NotFound);
    };
    let mut doc = cur.clone();
    let messages = messages_of(cur);
    let Some(pos) = messages.iter().position(|m| message_id(m).as_deref() == Some(through)) else {
        let done = compacted_ids(cur).contains(through) && summary.map_or(true, |s| cur.get("summary") == Some(s));
        if done {
            return Ok(None);
        }
        return Err(MergeError::UnknownThrough {
            through: through.to_owned(),
        });
    };
    let dropped: Vec<String> = messages[..=pos].iter().filter_map(message_id).collect();
    remember_compacted(&mut doc, dropped);
    doc.insert("messages".into(), Value::Array(messages[pos + 1..].to_vec()));
    if let Some(summary) = summary {
        doc.insert("summary".into(), summary.clone());
    }
    Ok(Some(doc))
}
