//! Replace: a deliberate whole-document replacement, if the document is still at `If-Match`.

use std::collections::HashSet;

use super::*;

pub(super) fn apply(
    session: &SessionId,
    current: Option<&Document>,
    incoming: &Document,
    if_match: Option<u64>,
    turn: u64,
    ids: &mut dyn IdSource,
    applied: &mut Applied,
) -> Result<Document, MergeError> {
    if let Some(cur) = current {
        check_life(cur, incoming)?;
    }
    let current_version = current.map(version_of).unwrap_or(0);
    let matches = match if_match {
        Some(v) => v == current_version,
        None => current.is_some(),
    };
    if !matches {
        return Err(MergeError::VersionMismatch {
            expected: if_match,
            current: current_version,
        });
    }
    let mut doc = empty(session);
    for (k, v) in incoming {
        if !MANAGED.contains(&k.as_str()) {
            doc.insert(k.clone(), v.clone());
        }
    }
    for field in [COMPACTED_IDS, LIFE] {
        if let Some(kept) = current.and_then(|c| c.get(field)) {
            doc.insert(field.into(), kept.clone());
        }
    }
    append_new(&mut doc, messages_of(incoming), turn, &HashSet::new(), ids, applied);
    Ok(doc)
}
