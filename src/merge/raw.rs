//! A batch of appends applied to the document as the store sent it: the fields and the
//! messages are kept as the store's raw JSON (`RawValue`, borrowed from the bytes read), never
//! parsed into values nor copied one by one; only each stored message's `id` is read, into an
//! index built once per batch. The new messages are the only JSON serialized, and the document
//! written back is the stored bytes around them.
//!
//! It gives the same document as [`BatchDoc`](super::BatchDoc) would for the same appends
//! (tested below); a document it cannot take as is (not an object, a stored message without an
//! id, `messages` not an array) is left to `BatchDoc`.

use std::borrow::Cow;
use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::Arc;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::history::{Fingerprint, Link};
use super::*;

/// One field of the document: as the store sent it, or set by the batch.
enum Field<'a> {
    Raw(&'a RawValue),
    Set(String),
}

impl Field<'_> {
    fn json(&self) -> &str {
        match self {
            Field::Raw(raw) => raw.get(),
            Field::Set(json) => json,
        }
    }
}

/// A message: as stored, or appended by the batch (serialized once).
enum Message<'a> {
    Stored(&'a RawValue),
    New(String),
}

impl Message<'_> {
    fn json(&self) -> &str {
        match self {
            Message::Stored(raw) => raw.get(),
            Message::New(json) => json,
        }
    }
}

/// The document's top-level members in order, values raw.
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members: Vec<(Cow<'de, str>, &'de RawValue)> = Vec::new();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let value: &'de RawValue = map.next_value()?;
                    // A repeated key: the last one counts, as when parsed into a map.
                    if let Some(slot) = members.iter_mut().find(|(k, _)| *k == key) {
                        slot.1 = value;
                    } else {
                        members.push((key, value));
                    }
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V)
    }
}

/// A top-level member of a stored document: `messages` read as its list of raw messages in
/// the same pass as the rest (the document's bytes are scanned once), any other member raw.
enum Member<'a> {
    Raw(&'a RawValue),
    Messages(Vec<&'a RawValue>),
}

/// The stored document's top-level members in order (see [`Member`]). A `messages` that is
/// not an array fails the parse: such a document is left to the value merge.
struct StoredMembers<'a>(Vec<(Cow<'a, str>, Member<'a>)>);

impl<'de: 'a, 'a> Deserialize<'de> for StoredMembers<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StoredMembers<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members: Vec<(Cow<'de, str>, Member<'de>)> = Vec::new();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let value = if key == "messages" {
                        Member::Messages(map.next_value()?)
                    } else {
                        Member::Raw(map.next_value()?)
                    };
                    // A repeated key: the last one counts, as when parsed into a map.
                    if let Some(slot) = members.iter_mut().find(|(k, _)| *k == key) {
                        slot.1 = value;
                    } else {
                        members.push((key, value));
                    }
                }
                Ok(StoredMembers(members))
            }
        }
        d.deserialize_map(V)
    }
}

/// Why [`with_version`] refused a body.
#[derive(Debug)]
pub enum NotADocument {
    /// Valid JSON, but not an object.
    NotAnObject,
    /// Not JSON.
    Malformed(serde_json::Error),
}

/// A JSON object's bytes with its top-level `version` set (added at the end when absent),
/// every other member copied as it is, without parsing it into values.
pub fn with_version(json: &[u8], version: u64) -> Result<Vec<u8>, NotADocument> {
    Ok(RawDocument::parse(json)?.with_version(version))
}

/// A JSON object checked once and kept as its members' bytes, to be written out at any
/// version without being parsed again (the reference store checks a document once and sets
/// its version under its own lock).
pub struct RawDocument<'a> {
    members: Members<'a>,
}

impl<'a> RawDocument<'a> {
    /// The object `json` is, or why it is not one.
    pub fn parse(json: &'a [u8]) -> Result<Self, NotADocument> {
        match serde_json::from_slice(json) {
            Ok(members) => Ok(Self { members }),
            Err(e) => Err(match serde_json::from_slice::<serde::de::IgnoredAny>(json) {
                Ok(_) => NotADocument::NotAnObject,
                Err(_) => NotADocument::Malformed(e),
            }),
        }
    }

    /// The object's bytes with its top-level `version` set (added at the end when absent).
    pub fn with_version(&self, version: u64) -> Vec<u8> {
        let Members(members) = &self.members;
        let size = members.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum::<usize>();
        let mut out = Vec::with_capacity(size + 32);
        out.push(b'{');
        let mut seen = false;
        for (i, (key, value)) in members.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let _ = serde_json::to_writer(&mut out, key);
            out.push(b':');
            if key == "version" {
                seen = true;
                out.extend_from_slice(version.to_string().as_bytes());
            } else {
                out.extend_from_slice(value.get().as_bytes());
            }
        }
        if !seen {
            if !members.is_empty() {
                out.push(b',');
            }
            out.extend_from_slice(format!("\"version\":{version}").as_bytes());
        }
        out.push(b'}');
        out
    }
}

/// What is read of a stored message: its id.
#[derive(Deserialize)]
struct MessageId<'a> {
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
}

/// The stored document a batch of appends is applied to, raw.
pub struct RawBatch<'a> {
    session: &'a SessionId,
    fields: Vec<(Cow<'a, str>, Field<'a>)>,
    messages: Vec<Message<'a>>,
    /// The id of each message of `messages`, in order (shared with `index` and the digest
    /// cache: a batch allocates no id of a message it has seen before).
    message_ids: Vec<Arc<str>>,
    /// The key in a [`DigestCache`] of each stored message (its bytes' hash and length).
    keys: Vec<(u64, usize)>,
    /// The ids an append skips: every stored message's and the recently compacted ones.
    index: HashSet<Arc<str>>,
    turn: u64,
    stored_version: u64,
}

impl<'a> RawBatch<'a> {
    /// The stored document, when it can be taken raw (see the module's comment).
    /// Ids are taken from `cache` for messages whose bytes it knows.
    pub fn parse(session: &'a SessionId, stored: &'a [u8], cache: &DigestCache) -> Option<Self> {
        let StoredMembers(members) = serde_json::from_slice(stored).ok()?;
        let mut fields = Vec::with_capacity(members.len());
        let mut messages = Vec::new();
        let mut message_ids = Vec::new();
        let mut keys = Vec::new();
        let mut index = HashSet::new();
        let (mut turn, mut version) = (0, 0);
        for (key, member) in members {
            let raw = match member {
                Member::Raw(raw) => raw,
                Member::Messages(list) => {
                    messages.reserve(list.len() + 16);
                    message_ids.reserve(list.len() + 16);
                    keys.reserve(list.len());
                    index.reserve(list.len() + 16);
                    for m in list {
                        // Only objects with a string id are taken raw.
                        if !m.get().starts_with('{') {
                            return None;
                        }
                        let key = cache.key(m.get());
                        let id = match cache.entries.get(&key) {
                            Some(known) => known.id.clone(),
                            None => Arc::from(serde_json::from_str::<MessageId>(m.get()).ok()?.id?),
                        };
                        index.insert(id.clone());
                        message_ids.push(id);
                        keys.push(key);
                        messages.push(Message::Stored(m));
                    }
                    // The messages keep their place among the fields (written by `finish`).
                    fields.push((key, Field::Set(String::new())));
                    continue;
                }
            };
            match &*key {
                "turn" => turn = serde_json::from_str::<Value>(raw.get()).ok()?.as_u64().unwrap_or(0),
                "version" => version = serde_json::from_str::<Value>(raw.get()).ok()?.as_u64().unwrap_or(0),
                COMPACTED_IDS => {
                    if let Ok(Value::Array(ids)) = serde_json::from_str::<Value>(raw.get()) {
                        index.extend(ids.iter().filter_map(Value::as_str).map(Arc::from));
                    }
                }
                _ => {}
            }
            fields.push((key, Field::Raw(raw)));
        }
        Some(Self {
            session,
            fields,
            messages,
            message_ids,
            keys,
            index,
            turn,
            stored_version: version,
        })
    }

    /// Applies one append, as [`BatchDoc::apply`](super::BatchDoc::apply) does.
    pub fn append(&mut self, turn: u64, incoming: &[Value], ids: &mut dyn IdSource) -> Result<Applied, MergeError> {
        if is_stale(turn, self.turn) {
            return Err(MergeError::StaleTurn {
                turn,
                current: self.turn,
            });
        }
        let mut applied = Applied {
            message_ids: Vec::with_capacity(incoming.len()),
        };
        for message in incoming {
            let (id, generated) = match message.get("id").and_then(Value::as_str) {
                Some(id) => (id.to_owned(), false),
                None => (ids.next_id(), true),
            };
            applied.message_ids.push(id.clone());
            if self.index.contains(id.as_str()) {
                continue;
            }
            let mut message = message.clone();
            if let Some(obj) = message.as_object_mut() {
                if generated {
                    obj.insert("id".into(), Value::String(id.clone()));
                }
                obj.entry("turn").or_insert_with(|| Value::from(turn));
            }
            self.messages.push(Message::New(message.to_string()));
            let id: Arc<str> = Arc::from(id);
            self.message_ids.push(id.clone());
            self.index.insert(id);
        }
        self.turn = self.turn.max(turn);
        Ok(applied)
    }

    /// The stored document's version.
    pub fn version(&self) -> u64 {
        self.stored_version
    }

    /// Sets a top-level field (added at the end when absent).
    fn set(&mut self, key: &'static str, json: String) {
        match self.fields.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = Field::Set(json),
            None => self.fields.push((Cow::Borrowed(key), Field::Set(json))),
        }
    }

    /// The document to write back at `version`, with `life` set when it has none.
    pub fn finish(mut self, version: u64, life: u64) -> Finished<'a> {
        if !self.fields.iter().any(|(k, _)| k == "messages") {
            self.fields.push((Cow::Borrowed("messages"), Field::Set(String::new())));
        }
        self.set("session", Value::String(self.session.as_str().to_owned()).to_string());
        self.set("turn", self.turn.to_string());
        self.set("version", version.to_string());
        if !self.fields.iter().any(|(k, _)| k == LIFE) {
            self.fields.push((Cow::Borrowed(LIFE), Field::Set(life.to_string())));
        }
        let size: usize = self
            .fields
            .iter()
            .map(|(k, v)| k.len() + v.json().len() + 4)
            .sum::<usize>()
            + self.messages.iter().map(|m| m.json().len() + 1).sum::<usize>()
            + 2;
        let mut out = String::with_capacity(size);
        out.push('{');
        for (i, (key, value)) in self.fields.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&Value::String(key.to_string()).to_string());
            out.push(':');
            if key == "messages" {
                out.push('[');
                for (j, m) in self.messages.iter().enumerate() {
                    if j > 0 {
                        out.push(',');
                    }
                    out.push_str(m.json());
                }
                out.push(']');
            } else {
                out.push_str(value.json());
            }
        }
        out.push('}');
        Finished { batch: self, body: out }
    }
}

/// A document written out by [`RawBatch::finish`].
pub struct Finished<'a> {
    batch: RawBatch<'a>,
    pub body: String,
}

impl Finished<'_> {
    pub fn turn(&self) -> u64 {
        self.batch.turn
    }

    /// How many messages the stored document held before the batch.
    pub fn stored_messages(&self) -> usize {
        self.batch.keys.len()
    }

    /// The document's snapshot (what [`Snapshot::of`] gives for it). Message digests are
    /// taken from `cache` where the message's bytes are unchanged, and `cache` is left with
    /// exactly this document's messages: a proxy digests each message once, not once per
    /// commit.
    #[cfg(test)]
    pub fn snapshot(&self, version: u64, cache: &mut DigestCache) -> Snapshot {
        let (field_digests, message_digests) = self.digests(cache);
        Snapshot {
            version,
            field_digests,
            message_ids: self.batch.message_ids.iter().map(|id| id.to_string()).collect(),
            message_digests: message_digests.iter().map(|d| d.to_string()).collect(),
            after: None,
        }
    }

    /// The document's snapshot as [`snapshot`](Self::snapshot) makes it, serialized: the ids
    /// and digests are written from where they are kept, never copied one by one. With
    /// `chained`, as a link to the stored version's snapshot (see [`history`](super::history)):
    /// only the messages this batch appended, and the fingerprint of the stored ones.
    pub fn snapshot_json(&self, version: u64, cache: &mut DigestCache, chained: bool) -> Vec<u8> {
        /// [`Snapshot`]'s serialized form, borrowed.
        #[derive(serde::Serialize)]
        struct Borrowed<'b> {
            version: u64,
            field_digests: Map<String, Value>,
            message_ids: Vec<&'b str>,
            message_digests: Vec<&'b str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            after: Option<Link>,
        }
        let (field_digests, message_digests) = self.digests(cache);
        let stored = if chained { self.batch.keys.len() } else { 0 };
        let after = chained.then(|| {
            let mut fingerprint = Fingerprint::default();
            for d in &message_digests[..stored] {
                fingerprint.add(d);
            }
            Link {
                version: self.batch.stored_version,
                fingerprint: fingerprint.value(),
            }
        });
        let out = Borrowed {
            version,
            field_digests,
            message_ids: self.batch.message_ids[stored..].iter().map(|id| &**id).collect(),
            message_digests: message_digests[stored..].iter().map(|d| &**d).collect(),
            after,
        };
        serde_json::to_vec(&out).unwrap_or_default()
    }

    /// The digest trees of the fields and the digest of each message (see
    /// [`snapshot`](Self::snapshot)), `cache` left with this document's messages.
    fn digests(&self, cache: &mut DigestCache) -> (Map<String, Value>, Vec<Arc<str>>) {
        let field_digests = self
            .batch
            .fields
            .iter()
            .filter(|(k, _)| k != "messages")
            .map(|(k, v)| {
                let value: Value = serde_json::from_str(v.json()).unwrap_or(Value::Null);
                (k.to_string(), digest_tree(&value))
            })
            .collect();
        let mut next = HashMap::with_capacity_and_hasher(self.batch.messages.len(), Default::default());
        let mut message_digests = Vec::with_capacity(self.batch.messages.len());
        for (i, (id, m)) in self.batch.message_ids.iter().zip(&self.batch.messages).enumerate() {
            let json = m.json();
            let key = match self.batch.keys.get(i) {
                Some(key) => *key,
                None => cache.key(json),
            };
            let known = match cache.entries.remove(&key) {
                Some(known) if known.id == *id => known,
                _ => Known {
                    id: id.clone(),
                    digest: Arc::from(digest(&serde_json::from_str::<Value>(json).unwrap_or(Value::Null))),
                },
            };
            message_digests.push(known.digest.clone());
            next.insert(key, known);
        }
        cache.entries = next;
        (field_digests, message_digests)
    }
}

/// What is known of the messages of a document's last snapshot, by a keyed hash and the
/// length of each message's bytes: its id and its digest. A message whose bytes are
/// unchanged is neither parsed for its id nor digested again.
#[derive(Default)]
pub struct DigestCache {
    /// Keyed at random: nobody can make two messages' hashes collide on purpose.
    hasher: RandomState,
    entries: HashMap<(u64, usize), Known, BuildHasherDefault<KeyHasher>>,
}

/// The hasher of a [`DigestCache`]'s map: its keys are already keyed hashes, so their bits are
/// taken as they are instead of being hashed a second time.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }

    fn write_usize(&mut self, n: usize) {
        self.0 ^= (n as u64).rotate_left(32);
    }
}

struct Known {
    id: Arc<str>,
    digest: Arc<str>,
}

impl DigestCache {
    fn key(&self, json: &str) -> (u64, usize) {
        (self.hasher.hash_one(json.as_bytes()), json.len())
    }

    /// How many messages it knows.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
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

    /// A merged document and each write's result.
    type Outcome = (Value, Vec<Result<Applied, MergeError>>);

    /// The raw merge's document and results, and `BatchDoc`'s, for the same appends.
    fn both(stored: &Value, appends: &[(u64, Vec<Value>)]) -> Option<(Outcome, Outcome)> {
        let session = sid();
        let bytes = serde_json::to_vec(stored).ok()?;
        let mut raw = RawBatch::parse(&session, &bytes, &DigestCache::default())?;
        let mut ids = Seq(0);
        let raw_results: Vec<_> = appends.iter().map(|(t, m)| raw.append(*t, m, &mut ids)).collect();
        let version = raw.version() + 1;
        let finished = raw.finish(version, 99);
        let raw_doc: Value = serde_json::from_str(&finished.body).ok()?;
        let mut batch = BatchDoc::new(&session, stored.as_object().cloned(), &mut Seq(1000));
        let mut ids = Seq(0);
        let results: Vec<_> = appends
            .iter()
            .map(|(t, m)| batch.apply(*t, &Op::Append { messages: m.clone() }, None, &mut ids))
            .collect();
        let mut doc = batch.into_document();
        doc.insert("version".into(), json!(version));
        doc.entry(LIFE).or_insert_with(|| json!(99));
        Some(((raw_doc, raw_results), (Value::Object(doc), results)))
    }

    #[test]
    fn the_raw_merge_writes_what_the_value_merge_writes() {
        let stored = json!({"session": "s-1", "turn": 3, "version": 7, "state": {"a": [1, {"b": "\u{e9}\n"}]},
            "messages": [{"id": "m-1", "turn": 1, "content": "x \" y"}, {"id": "m-2", "turn": 3, "extra": {"k": [1, 2]}}],
            "compacted_ids": ["m-0"], "summary": null, "app": 1.5});
        let appends = [
            (
                3,
                vec![
                    json!({"id": "m-3", "content": "z"}),
                    json!({"id": "m-1"}),
                    json!({"role": "tool"}),
                ],
            ),
            (2, vec![json!({"id": "m-9"})]),
            (
                5,
                vec![
                    json!({"id": "m-0"}),
                    json!({"id": "m-4", "turn": 9}),
                    json!({"id": "m-3"}),
                ],
            ),
        ];
        let Some((raw, values)) = both(&stored, &appends) else {
            panic!("the raw merge did not take a plain document");
        };
        assert_eq!(raw, values);
    }

    #[test]
    fn the_stored_order_of_fields_is_kept() {
        let session = sid();
        let bytes = br#"{"a":1,"messages":[{"id":"m-1"}],"z":2,"session":"s-1","turn":1,"version":3}"#;
        let Some(mut raw) = RawBatch::parse(&session, bytes, &DigestCache::default()) else {
            panic!("not taken raw");
        };
        let _ = raw.append(1, &[json!({"id": "m-2"})], &mut Seq(0));
        let body = raw.finish(4, 9).body;
        let keys: Vec<String> = serde_json::from_str::<Map<String, Value>>(&body)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        assert_eq!(keys, ["a", "messages", "z", "session", "turn", "version", "life"]);
    }

    #[test]
    fn a_document_without_messages_or_life_gets_both() {
        let stored = json!({"session": "s-1", "turn": 0, "version": 1});
        let appends = [(1, vec![json!({"id": "m-1"})])];
        let Some((raw, values)) = both(&stored, &appends) else {
            panic!("the raw merge did not take a document without messages");
        };
        assert_eq!(raw, values);
        assert_eq!(raw.0["life"], json!(99));
    }

    #[test]
    fn with_version_sets_the_version_and_keeps_every_other_member() {
        for doc in [
            json!({}),
            json!({"version": 3, "a": [1, {"b": "\u{e9}"}], "c": null}),
            json!({"a": "x \" y", "messages": [{"id": "m"}]}),
        ] {
            let bytes = serde_json::to_vec(&doc).unwrap_or_default();
            let out = with_version(&bytes, 9).map(|b| serde_json::from_slice::<Value>(&b).ok());
            let mut expected = doc.clone();
            expected["version"] = json!(9);
            assert!(matches!(out, Ok(Some(v)) if v == expected), "{doc}");
        }
        assert!(matches!(with_version(b"[1]", 1), Err(NotADocument::NotAnObject)));
        assert!(matches!(with_version(b"{\"a\":", 1), Err(NotADocument::Malformed(_))));
    }

    #[test]
    fn documents_the_raw_merge_cannot_take_are_left_to_the_value_merge() {
        let session = sid();
        for stored in [
            json!({"messages": [{"turn": 1}]}),
            json!({"messages": [{"id": 5}]}),
            json!({"messages": {"id": "m-1"}}),
            json!({"messages": ["m-1"]}),
            json!([1, 2]),
        ] {
            let bytes = serde_json::to_vec(&stored).unwrap_or_default();
            assert!(
                RawBatch::parse(&session, &bytes, &DigestCache::default()).is_none(),
                "{stored} taken raw"
            );
        }
    }

    #[test]
    fn snapshots_from_raw_bytes_equal_snapshots_of_values_and_reuse_digests() {
        let session = sid();
        let stored = json!({"session": "s-1", "turn": 1, "version": 2, "state": {"p": {"q": 1}},
            "messages": [{"id": "m-1", "b": 1, "a": 2}, {"id": "m-2"}]});
        let bytes = serde_json::to_vec(&stored).unwrap_or_default();
        let stored_doc = stored.as_object().unwrap_or_else(|| unreachable!());
        let mut cache = DigestCache::default();
        for round in 0..4 {
            let Some(mut raw) = RawBatch::parse(&session, &bytes, &cache) else {
                panic!("not taken raw");
            };
            let _ = raw.append(1, &[json!({"id": format!("n-{round}")})], &mut Seq(0));
            let finished = raw.finish(3, 7);
            let doc: Value = serde_json::from_str(&finished.body).unwrap_or_default();
            let expected = Snapshot::of(doc.as_object().unwrap_or(&Map::new()));
            // Alternately as a value and serialized, as the proxy stores it.
            if round % 2 == 0 {
                assert_eq!(finished.snapshot(3, &mut cache), expected);
            } else {
                let stored = serde_json::from_slice::<Snapshot>(&finished.snapshot_json(3, &mut cache, false));
                assert!(matches!(stored, Ok(ref s) if *s == expected), "{stored:?}");
                // Chained to the stored version's whole snapshot, it gives the same.
                let below = Snapshot::of(stored_doc);
                let link = serde_json::from_slice::<Snapshot>(&finished.snapshot_json(3, &mut cache, true));
                let link = link.unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(link.message_ids, vec![format!("n-{round}")]);
                assert_eq!(super::super::history::assemble(vec![link, below]), Some(expected));
            }
            assert_eq!(cache.len(), 3, "the cache holds this document's messages only");
        }
    }

    fn message() -> impl Strategy<Value = Value> {
        (0u8..6, proptest::option::of(0u64..5), "[a-z\"\\\\é ]{0,6}").prop_map(|(id, turn, text)| {
            let mut m = json!({"id": format!("m-{id}"), "content": text});
            if let Some(t) = turn {
                m["turn"] = json!(t);
            }
            if id == 5 {
                m.as_object_mut().map(|o| o.remove("id"));
            }
            m
        })
    }

    proptest! {
        #[test]
        fn raw_and_value_merges_agree(
            stored_ids in proptest::collection::btree_set(0u8..8, 0..6),
            compacted in proptest::collection::vec(0u8..8, 0..3),
            turn in 0u64..4,
            appends in proptest::collection::vec((0u64..5, proptest::collection::vec(message(), 0..4)), 1..6),
        ) {
            let messages: Vec<Value> = stored_ids.iter().map(|i| json!({"id": format!("m-{i}"), "turn": 1})).collect();
            let compacted: Vec<String> = compacted.iter().map(|i| format!("m-{i}")).collect();
            let stored = json!({"session": "s-1", "turn": turn, "version": 4, "messages": messages,
                "compacted_ids": compacted, "state": {}});
            let (raw, values) = both(&stored, &appends).expect("taken raw");
            prop_assert_eq!(raw, values);
        }
    }
}
