//! A batch of writes applied in place to one document: the document read once is changed by
//! each write in turn, never copied for an append, and the index of its message ids (stored
//! and recently compacted) is built once and kept up to date by the appends.

use std::collections::HashSet;

use serde_json::Value;

use super::*;

/// The document a batch is applied to.
pub struct BatchDoc<'s> {
    session: &'s SessionId,
    doc: Document,
    /// Whether a document is there: it was stored, or a write of the batch created it.
    present: bool,
    /// The ids an append skips: every stored message's and the recently compacted ones.
    /// Built on the first append, dropped when another kind of write replaces the document.
    index: Option<HashSet<String>>,
}

impl<'s> BatchDoc<'s> {
    /// The stored document (`None` when absent); stored messages without an id get one here,
    /// once, and are written back with it.
    pub fn new(session: &'s SessionId, current: Option<Document>, ids: &mut dyn IdSource) -> Self {
        let present = current.is_some();
        let mut doc = current.unwrap_or_else(|| empty(session));
        if let Some(Value::Array(list)) = doc.get_mut("messages") {
            if list.iter().any(|m| message_id(m).is_none()) {
                assign_ids(list, ids);
            }
        }
        Self {
            session,
            doc,
            present,
            index: None,
        }
    }

    /// The document as the batch has made it so far (`None`: none stored, none created yet).
    pub fn current(&self) -> Option<&Document> {
        self.present.then_some(&self.doc)
    }

    /// The document, to write back.
    pub fn into_document(self) -> Document {
        self.doc
    }

    /// Applies one write; what [`apply`] would give, without copying the document for an
    /// append.
    pub fn apply(
        &mut self,
        turn: u64,
        op: &Op,
        base: Option<&Snapshot>,
        ids: &mut dyn IdSource,
    ) -> Result<Applied, MergeError> {
        if let Op::Append { messages } = op {
            return self.append(turn, messages, ids);
        }
        let (next, applied) = apply(self.session, self.current(), turn, op, base, ids)?;
        self.doc = next;
        self.present = true;
        self.index = None;
        Ok(applied)
    }

    fn append(&mut self, turn: u64, incoming: &[Value], ids: &mut dyn IdSource) -> Result<Applied, MergeError> {
        let stored_turn = turn_of(&self.doc);
        if self.present && is_stale(turn, stored_turn) {
            return Err(MergeError::StaleTurn {
                turn,
                current: stored_turn,
            });
        }
        let doc = &mut self.doc;
        let index = self.index.get_or_insert_with(|| {
            let mut index: HashSet<String> = messages_of(doc).iter().filter_map(message_id).collect();
            index.extend(compacted_ids(doc).into_iter().map(str::to_owned));
            index
        });
        let mut applied = Applied {
            message_ids: Vec::with_capacity(incoming.len()),
        };
        let messages = doc.entry("messages").or_insert_with(|| Value::Array(Vec::new()));
        if !messages.is_array() {
            *messages = Value::Array(Vec::new());
        }
        if let Value::Array(list) = messages {
            for message in incoming {
                let (id, generated) = match message.get("id").and_then(Value::as_str) {
                    Some(id) => (id.to_owned(), false),
                    None => (ids.next_id(), true),
                };
                applied.message_ids.push(id.clone());
                if index.contains(&id) {
                    continue;
                }
                let mut message = message.clone();
                if let Some(obj) = message.as_object_mut() {
                    if generated {
                        obj.insert("id".into(), Value::String(id.clone()));
                    }
                    obj.entry("turn").or_insert_with(|| Value::from(turn));
                }
                index.insert(id);
                list.push(message);
            }
        }
        let version = if self.present { version_of(doc) } else { 0 } + 1;
        doc.insert("session".into(), Value::String(self.session.as_str().to_owned()));
        doc.insert("turn".into(), Value::from(stored_turn.max(turn)));
        doc.insert("version".into(), Value::from(version));
        self.present = true;
        Ok(applied)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    struct Seq(u64);
    impl IdSource for Seq {
        fn next_id(&mut self) -> String {
            self.0 += 1;
            format!("g-{}", self.0)
        }
    }

    fn sid() -> SessionId {
        SessionId::parse("s-1").expect("valid id")
    }

    /// Every batch of appends and compactions gives, in place, what applying each write to a
    /// copy of the previous document gives.
    #[test]
    fn in_place_equals_one_write_at_a_time() {
        let session = sid();
        let stored = json!({"session": "s-1", "turn": 3, "version": 7, "state": {"a": 1},
            "messages": [{"id": "m-1", "turn": 1}, {"turn": 2, "role": "user"}, {"id": "m-3", "turn": 3}],
            "compacted_ids": ["m-0"]});
        let stored = stored.as_object().cloned().unwrap_or_default();
        let ops = [
            (
                3,
                Op::Append {
                    messages: vec![json!({"id": "m-4"}), json!({"id": "m-1"}), json!({"role": "x"})],
                },
            ),
            (
                4,
                Op::Append {
                    messages: vec![json!({"id": "m-0"}), json!({"id": "m-5", "turn": 9})],
                },
            ),
            (
                2,
                Op::Append {
                    messages: vec![json!({"id": "m-6"})],
                },
            ),
            (
                4,
                Op::Compact {
                    through: "m-3".into(),
                    summary: Some(json!("s")),
                },
            ),
            (
                4,
                Op::Append {
                    messages: vec![json!({"id": "m-3"}), json!({"id": "m-4"}), json!({"id": "m-7"})],
                },
            ),
        ];
        let mut batch = BatchDoc::new(&session, Some(stored.clone()), &mut Seq(0));
        let mut ids_a = Seq(100);
        let in_place: Vec<_> = ops
            .iter()
            .map(|(t, op)| batch.apply(*t, op, None, &mut ids_a))
            .collect();
        let mut doc = stored;
        let mut first = Seq(0);
        if let Some(Value::Array(list)) = doc.get_mut("messages") {
            assign_ids(list, &mut first);
        }
        let mut ids_b = Seq(100);
        let one_by_one: Vec<_> = ops
            .iter()
            .map(|(t, op)| {
                apply(&session, Some(&doc), *t, op, None, &mut ids_b).map(|(next, applied)| {
                    doc = next;
                    applied
                })
            })
            .collect();
        assert_eq!(in_place, one_by_one);
        assert_eq!(batch.into_document(), doc);
    }

    #[test]
    fn an_append_creates_an_absent_document() {
        let session = sid();
        let mut batch = BatchDoc::new(&session, None, &mut Seq(0));
        assert!(batch.current().is_none());
        let applied = batch
            .apply(
                2,
                &Op::Append {
                    messages: vec![json!({"id": "m-1"})],
                },
                None,
                &mut Seq(0),
            )
            .map(|a| a.message_ids);
        assert_eq!(applied, Ok(vec!["m-1".to_owned()]));
        let (expected, _) = apply(
            &session,
            None,
            2,
            &Op::Append {
                messages: vec![json!({"id": "m-1"})],
            },
            None,
            &mut Seq(0),
        )
        .unwrap_or_default();
        assert_eq!(batch.into_document(), expected);
    }
}
