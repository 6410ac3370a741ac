//! A batch of appends applied to the document as the store sent it: the fields and the
//! messages are kept as the store's raw JSON (`RawValue`, borrowed from the bytes read), never
//! parsed into values nor copied one by one; only each stored message's `id` is read, into an
//! index built once per batch. The new messages are the only JSON serialized, and the document
//! written back is the stored bytes around them.
//!
//! It gives the same document as [`BatchDoc`](super::BatchDoc) would for the same appends
//! (tested below); a document it cannot take as is (not an object, a stored message without an
//! id, `messages` not an array) is left to `BatchDoc`.
//!
//! A document this proxy wrote last, read again after other proxies appended to it, is not
//! parsed whole: only what follows the messages it wrote (see [`resume`](super::resume)).

use std::borrow::Cow;
use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::history::{Fingerprint, Link};
use super::resume::{self, LastWrite};
use super::*;

/// One field of the document: as the store sent it (checked JSON), or set by the batch.
enum Field<'a> {
    Raw(&'a [u8]),
    Set(String),
}

impl Field<'_> {
    fn json(&self) -> &[u8] {
        match self {
            Field::Raw(raw) => raw,
            Field::Set(json) => json.as_bytes(),
        }
    }
}

/// A message: as stored (checked JSON), or appended by the batch (serialized once).
enum Message<'a> {
    Stored(&'a [u8]),
    New(String),
}

impl Message<'_> {
    fn json(&self) -> &[u8] {
        match self {
            Message::Stored(raw) => raw,
            Message::New(json) => json.as_bytes(),
        }
    }
}

/// The document's top-level members in order, values raw.
pub(super) struct Members<'a>(pub(super) Vec<(Cow<'a, str>, &'a RawValue)>);

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
    /// The ids of the messages (stored and appended): an append skips them.
    index: HashSet<Arc<str>>,
    /// The recently compacted ids: an append skips them too.
    compacted: HashSet<Arc<str>>,
    /// The digests of the first stored messages and their fingerprint, known from this
    /// proxy's last write of the document.
    known: Option<(Vec<Arc<str>>, Fingerprint)>,
    turn: u64,
    stored_version: u64,
}

/// What a parse read of the stored document, before [`RawBatch::complete`].
struct Read<'a> {
    fields: Vec<(Cow<'a, str>, Field<'a>)>,
    messages: Vec<Message<'a>>,
    message_ids: Vec<Arc<str>>,
    keys: Vec<(u64, usize)>,
    index: HashSet<Arc<str>>,
    known: Option<(Vec<Arc<str>>, Fingerprint)>,
}

impl<'a> Read<'a> {
    fn reserve(&mut self, more: usize) {
        self.messages.reserve(more + 16);
        self.message_ids.reserve(more + 16);
        self.keys.reserve(more);
        self.index.reserve(more + 16);
    }

    /// A stored message; `None` when it is not an object with a string id (the document is
    /// then left to the value merge).
    fn push(&mut self, m: &'a [u8], cache: &DigestCache) -> Option<()> {
        let (id, key) = stored_message(m, cache)?;
        self.index.insert(id.clone());
        self.message_ids.push(id);
        self.keys.push(key);
        self.messages.push(Message::Stored(m));
        Some(())
    }
}

impl<'a> RawBatch<'a> {
    /// The stored document, when it can be taken raw (see the module's comment).
    /// Ids are taken from `cache` for messages whose bytes it knows, and the messages this
    /// proxy wrote last are not parsed again when the document still begins with them.
    pub fn parse(session: &'a SessionId, stored: &'a [u8], cache: &mut DigestCache) -> Option<Self> {
        if let Some(last) = cache.last.take() {
            if let Some(resumed) = last.resume(stored) {
                return Self::resumed(session, stored, cache, last, resumed);
            }
        }
        Self::parse_whole(session, stored, cache)
    }

    fn parse_whole(session: &'a SessionId, stored: &'a [u8], cache: &DigestCache) -> Option<Self> {
        let StoredMembers(members) = serde_json::from_slice(stored).ok()?;
        let mut read = Read {
            fields: Vec::with_capacity(members.len()),
            messages: Vec::new(),
            message_ids: Vec::new(),
            keys: Vec::new(),
            index: HashSet::new(),
            known: None,
        };
        for (key, member) in members {
            let raw = match member {
                Member::Raw(raw) => raw,
                Member::Messages(list) => {
                    read.reserve(list.len());
                    for m in list {
                        read.push(m.get().as_bytes(), cache)?;
                    }
                    // The messages keep their place among the fields (written by `finish`).
                    read.fields.push((key, Field::Set(String::new())));
                    continue;
                }
            };
            read.fields.push((key, Field::Raw(raw.get().as_bytes())));
        }
        Self::complete(session, read)
    }

    /// The document read again after this proxy's last write of it (see [`resume`]).
    fn resumed(
        session: &'a SessionId,
        stored: &'a [u8],
        cache: &mut DigestCache,
        last: LastWrite,
        resumed: resume::Resumed<'a>,
    ) -> Option<Self> {
        // The shared messages, where they are in the document read.
        let (shift, from) = (resumed.shared_at, last.list.start);
        let mut messages = Vec::with_capacity(last.ranges.len() + resumed.added.len() + 16);
        for r in &last.ranges {
            let at = r.start.checked_sub(from)? + shift..r.end.checked_sub(from)? + shift;
            messages.push(Message::Stored(stored.get(at)?));
        }
        let mut members = resumed.before;
        let at = members.len();
        for (key, value) in resumed.after {
            resume::put(&mut members, key, value);
        }
        let mut fields: Vec<_> = members.into_iter().map(|(k, v)| (k, Field::Raw(v))).collect();
        fields.insert(at, (Cow::Borrowed("messages"), Field::Set(String::new())));
        let mut read = Read {
            fields,
            messages,
            message_ids: last.ids,
            keys: last.keys,
            index: last.index,
            known: last.digests,
        };
        read.reserve(resumed.added.len());
        for m in resumed.added {
            read.push(m, cache)?;
        }
        Self::complete(session, read)
    }

    /// Completes a parse: the turn, the version and the compacted ids read from the fields.
    fn complete(session: &'a SessionId, read: Read<'a>) -> Option<Self> {
        let (mut turn, mut version) = (0, 0);
        let mut compacted = HashSet::new();
        for (key, field) in &read.fields {
            match &**key {
                "turn" => {
                    turn = serde_json::from_slice::<Value>(field.json())
                        .ok()?
                        .as_u64()
                        .unwrap_or(0)
                }
                "version" => {
                    version = serde_json::from_slice::<Value>(field.json())
                        .ok()?
                        .as_u64()
                        .unwrap_or(0)
                }
                COMPACTED_IDS => {
                    if let Ok(Value::Array(ids)) = serde_json::from_slice::<Value>(field.json()) {
                        compacted.extend(ids.iter().filter_map(Value::as_str).map(Arc::from));
                    }
                }
                _ => {}
            }
        }
        Some(Self {
            session,
            fields: read.fields,
            messages: read.messages,
            message_ids: read.message_ids,
            keys: read.keys,
            index: read.index,
            compacted,
            known: read.known,
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
            if self.index.contains(id.as_str()) || self.compacted.contains(id.as_str()) {
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
        let mut out = Vec::with_capacity(size);
        let mut ranges = Vec::with_capacity(self.messages.len());
        let mut list = 0..0;
        out.push(b'{');
        for (i, (key, value)) in self.fields.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let _ = serde_json::to_writer(&mut out, &**key);
            out.push(b':');
            if key == "messages" {
                out.push(b'[');
                list.start = out.len();
                for (j, m) in self.messages.iter().enumerate() {
                    if j > 0 {
                        out.push(b',');
                    }
                    let at = out.len();
                    out.extend_from_slice(m.json());
                    ranges.push(at..out.len());
                }
                list.end = out.len();
                out.push(b']');
            } else {
                out.extend_from_slice(value.json());
            }
        }
        out.push(b'}');
        Finished {
            batch: self,
            body: out,
            list,
            ranges,
        }
    }
}

/// A document written out by [`RawBatch::finish`].
pub struct Finished<'a> {
    batch: RawBatch<'a>,
    pub body: Vec<u8>,
    /// Where the message list is in `body` (past its `[`, to the end of its last message),
    /// and each message.
    list: Range<usize>,
    ranges: Vec<Range<usize>>,
}

/// The digests of a written document's messages and their fingerprint, as its snapshot made
/// them: kept with the write (see [`Finished::remember`]).
pub struct Digested {
    digests: Vec<Arc<str>>,
    fingerprint: Fingerprint,
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
    /// taken from `cache` where the message's bytes are unchanged: a proxy digests each
    /// message once, not once per commit.
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
    /// only the messages this batch appended, and the fingerprint of the stored ones. Also
    /// the digests it used, for [`remember`](Self::remember).
    pub fn snapshot_json(&self, version: u64, cache: &mut DigestCache, chained: bool) -> (Vec<u8>, Digested) {
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
        let stored = self.batch.keys.len();
        // The fingerprint of the stored messages, from what the last write knew of them.
        let (mut fingerprint, from) = match &self.batch.known {
            Some((known, fingerprint)) => (fingerprint.clone(), known.len()),
            None => (Fingerprint::default(), 0),
        };
        for d in &message_digests[from.min(stored)..stored] {
            fingerprint.add(d);
        }
        let after = chained.then(|| Link {
            version: self.batch.stored_version,
            fingerprint: fingerprint.value(),
        });
        let from = if chained { stored } else { 0 };
        let out = Borrowed {
            version,
            field_digests,
            message_ids: self.batch.message_ids[from..].iter().map(|id| &**id).collect(),
            message_digests: message_digests[from..].iter().map(|d| &**d).collect(),
            after,
        };
        let json = serde_json::to_vec(&out).unwrap_or_default();
        for d in &message_digests[stored..] {
            fingerprint.add(d);
        }
        (
            json,
            Digested {
                digests: message_digests,
                fingerprint,
            },
        )
    }

    /// The digest trees of the fields and the digest of each message (see
    /// [`snapshot`](Self::snapshot)). `cache` learns the messages it did not know; it is
    /// left with this document's messages only when it holds many more.
    fn digests(&self, cache: &mut DigestCache) -> (Map<String, Value>, Vec<Arc<str>>) {
        let field_digests = self
            .batch
            .fields
            .iter()
            .filter(|(k, _)| k != "messages")
            .map(|(k, v)| {
                let value: Value = serde_json::from_slice(v.json()).unwrap_or(Value::Null);
                (k.to_string(), digest_tree(&value))
            })
            .collect();
        let count = self.batch.messages.len();
        let mut message_digests = Vec::with_capacity(count);
        // The first messages' digests, known from the last write: the same bytes.
        if let Some((known, _)) = &self.batch.known {
            message_digests.extend(known.iter().take(count).cloned());
        }
        let from = message_digests.len();
        let mut keys = Vec::with_capacity(count - from);
        for (i, (id, m)) in self
            .batch
            .message_ids
            .iter()
            .zip(&self.batch.messages)
            .enumerate()
            .skip(from)
        {
            let json = m.json();
            let key = match self.batch.keys.get(i) {
                Some(key) => *key,
                None => cache.key(json),
            };
            let known = match cache.entries.get(&key) {
                Some(known) if known.id == *id => known.digest.clone(),
                _ => {
                    let digest: Arc<str> =
                        Arc::from(digest(&serde_json::from_slice::<Value>(json).unwrap_or(Value::Null)));
                    cache.entries.insert(
                        key,
                        Known {
                            id: id.clone(),
                            digest: digest.clone(),
                        },
                    );
                    digest
                }
            };
            message_digests.push(known);
            keys.push(key);
        }
        // Messages no longer in the document (compacted, changed) are forgotten once they
        // are as many as the document's: the cache stays within twice its messages.
        if cache.entries.len() > 2 * count + 64 {
            let current: HashSet<(u64, usize)> = self.batch.keys.iter().chain(&keys).copied().collect();
            cache.entries.retain(|k, _| current.contains(k));
        }
        (field_digests, message_digests)
    }

    /// Keeps what this write learnt of its document's messages in `cache`, with the bytes
    /// written (`body`, the bytes of [`Finished::body`]), for the next batch that reads the
    /// document again (see [`resume`]). Called once the store took the write.
    pub fn remember(self, body: Bytes, digested: Option<Digested>, cache: &mut DigestCache) {
        if body.len() < self.list.end {
            cache.last = None;
            return;
        }
        let stored = self.batch.keys.len();
        let mut keys = self.batch.keys;
        keys.extend(self.batch.messages[stored..].iter().map(|m| cache.key(m.json())));
        cache.last = Some(LastWrite {
            body,
            list: self.list,
            ranges: self.ranges,
            ids: self.batch.message_ids,
            keys,
            index: self.batch.index,
            digests: digested.map(|d| (d.digests, d.fingerprint)),
        });
    }
}

/// A stored message's id and cache key; `None` when it is not an object with a string id.
fn stored_message(m: &[u8], cache: &DigestCache) -> Option<(Arc<str>, (u64, usize))> {
    if m.first() != Some(&b'{') {
        return None;
    }
    let key = cache.key(m);
    let id = match cache.entries.get(&key) {
        Some(known) => known.id.clone(),
        None => Arc::from(serde_json::from_slice::<MessageId>(m).ok()?.id?),
    };
    Some((id, key))
}

/// What is known of the messages of a document's last snapshot, by a keyed hash and the
/// length of each message's bytes: its id and its digest. A message whose bytes are
/// unchanged is neither parsed for its id nor digested again.
#[derive(Default)]
pub struct DigestCache {
    /// Keyed at random: nobody can make two messages' hashes collide on purpose.
    hasher: RandomState,
    entries: HashMap<(u64, usize), Known, BuildHasherDefault<KeyHasher>>,
    /// The document as this proxy last wrote it, while no other batch of this proxy read it.
    last: Option<LastWrite>,
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
    fn key(&self, json: &[u8]) -> (u64, usize) {
        (self.hasher.hash_one(json), json.len())
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
        let mut raw = RawBatch::parse(&session, &bytes, &mut DigestCache::default())?;
        let mut ids = Seq(0);
        let raw_results: Vec<_> = appends.iter().map(|(t, m)| raw.append(*t, m, &mut ids)).collect();
        let version = raw.version() + 1;
        let finished = raw.finish(version, 99);
        let raw_doc: Value = serde_json::from_slice(&finished.body).ok()?;
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
        let Some(mut raw) = RawBatch::parse(&session, bytes, &mut DigestCache::default()) else {
            panic!("not taken raw");
        };
        let _ = raw.append(1, &[json!({"id": "m-2"})], &mut Seq(0));
        let body = raw.finish(4, 9).body;
        let keys: Vec<String> = serde_json::from_slice::<Map<String, Value>>(&body)
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
                RawBatch::parse(&session, &bytes, &mut DigestCache::default()).is_none(),
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
            let Some(mut raw) = RawBatch::parse(&session, &bytes, &mut cache) else {
                panic!("not taken raw");
            };
            let _ = raw.append(1, &[json!({"id": format!("n-{round}")})], &mut Seq(0));
            let finished = raw.finish(3, 7);
            let doc: Value = serde_json::from_slice(&finished.body).unwrap_or_default();
            let expected = Snapshot::of(doc.as_object().unwrap_or(&Map::new()));
            // Alternately as a value and serialized, as the proxy stores it.
            if round % 2 == 0 {
                assert_eq!(finished.snapshot(3, &mut cache), expected);
            } else {
                let stored = serde_json::from_slice::<Snapshot>(&finished.snapshot_json(3, &mut cache, false).0);
                assert!(matches!(stored, Ok(ref s) if *s == expected), "{stored:?}");
                // Chained to the stored version's whole snapshot, it gives the same.
                let below = Snapshot::of(stored_doc);
                let link = serde_json::from_slice::<Snapshot>(&finished.snapshot_json(3, &mut cache, true).0);
                let link = link.unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(link.message_ids, vec![format!("n-{round}")]);
                assert_eq!(super::super::history::assemble(vec![link, below]), Some(expected));
            }
            assert!(cache.len() <= 3 + round + 1, "the cache holds what it digested only");
        }
    }

    /// One batch of this proxy on `stored`: parsed with `cache` (resumed when it can be) and
    /// with a cache of its own (parsed whole); both must write the same bytes, answer the same
    /// and snapshot the same, chained or not. Returns the bytes written, and whether the
    /// parse resumed.
    fn batch_both_ways(stored: &[u8], appends: &[(u64, Vec<Value>)], cache: &mut DigestCache) -> (Vec<u8>, bool) {
        let session = sid();
        let resumed = cache.last.as_ref().is_some_and(|last| last.resume(stored).is_some());
        let whole = RawBatch::parse(&session, stored, &mut DigestCache::default());
        let parsed = RawBatch::parse(&session, stored, cache);
        let (Some(mut whole), Some(mut parsed)) = (whole, parsed) else {
            assert!(
                RawBatch::parse(&session, stored, &mut DigestCache::default()).is_none(),
                "taken raw one way only: {}",
                String::from_utf8_lossy(stored)
            );
            cache.last = None;
            return (stored.to_vec(), false);
        };
        let a: Vec<_> = appends.iter().map(|(t, m)| whole.append(*t, m, &mut Seq(0))).collect();
        let b: Vec<_> = appends.iter().map(|(t, m)| parsed.append(*t, m, &mut Seq(0))).collect();
        assert_eq!(a, b);
        let version = whole.version() + 1;
        let whole = whole.finish(version, 5);
        let mut parsed = parsed.finish(version, 5);
        assert_eq!(
            String::from_utf8_lossy(&whole.body),
            String::from_utf8_lossy(&parsed.body)
        );
        for chained in [false, true] {
            let (x, _) = whole.snapshot_json(version, &mut DigestCache::default(), chained);
            let (y, _) = parsed.snapshot_json(version, cache, chained);
            assert_eq!(
                String::from_utf8_lossy(&x),
                String::from_utf8_lossy(&y),
                "chained: {chained}"
            );
        }
        let (_, digested) = parsed.snapshot_json(version, cache, true);
        let body = std::mem::take(&mut parsed.body);
        parsed.remember(Bytes::from(body.clone()), Some(digested), cache);
        (body, resumed)
    }

    /// What another writer does to a document between two batches of this proxy.
    #[derive(Clone, Debug)]
    enum Other {
        /// Another proxy's batch of appends (raw, as it writes).
        Appends(Vec<Value>),
        /// A member before the messages changed (a longer version, a new state).
        FieldBefore(String),
        /// A member added after the messages.
        FieldAfter(String, String),
        /// Whitespace around the messages' commas and brackets.
        Spaces,
        /// The first message changed, or removed (a compaction).
        ChangeFirst,
        RemoveFirst,
        /// `compacted_ids` set after the messages.
        CompactedAfter(u8),
        /// Bytes that are no JSON after the list.
        Broken,
    }

    fn other() -> impl Strategy<Value = Other> {
        prop_oneof![
            4 => proptest::collection::vec(message(), 1..3).prop_map(Other::Appends),
            1 => "[0-9]{1,3}".prop_map(Other::FieldBefore),
            1 => ("[a-z]{1,2}", "[0-9]{1,2}").prop_map(|(k, v)| Other::FieldAfter(k, v)),
            1 => Just(Other::Spaces),
            1 => Just(Other::ChangeFirst),
            1 => Just(Other::RemoveFirst),
            1 => (0u8..8).prop_map(Other::CompactedAfter),
            1 => Just(Other::Broken),
        ]
    }

    fn apply_other(stored: Vec<u8>, other: &Other, cache: &mut DigestCache) -> Vec<u8> {
        let text = String::from_utf8(stored.clone()).unwrap_or_default();
        match other {
            Other::Appends(messages) => {
                let session = sid();
                let Some(mut raw) = RawBatch::parse(&session, &stored, cache) else {
                    return stored;
                };
                let _ = raw.append(9, messages, &mut Seq(500));
                let version = raw.version() + 1;
                let mut done = raw.finish(version, 5);
                let body = std::mem::take(&mut done.body);
                done.remember(Bytes::from(body.clone()), None, cache);
                body
            }
            Other::FieldBefore(v) => text
                .replacen(r#""turn":"#, &format!(r#""state":{v},"turn":"#), 1)
                .into_bytes(),
            Other::FieldAfter(k, v) => match text.rfind('}') {
                Some(end) => format!(r#"{},"{k}":{v}}}"#, &text[..end]).into_bytes(),
                None => stored,
            },
            Other::Spaces => text.replace("},{", "} , {").replace("}]", "} ]").into_bytes(),
            Other::ChangeFirst => text
                .replacen(r#""content":"#, r#""content":"changed","x":"#, 1)
                .into_bytes(),
            Other::RemoveFirst => {
                let mut doc: Map<String, Value> = serde_json::from_slice(&stored).unwrap_or_default();
                if let Some(Value::Array(list)) = doc.get_mut("messages") {
                    if !list.is_empty() {
                        list.remove(0);
                    }
                }
                serde_json::to_vec(&doc).unwrap_or_default()
            }
            Other::CompactedAfter(i) => match text.rfind('}') {
                Some(end) => format!(r#"{},"compacted_ids":["m-{i}"]}}"#, &text[..end]).into_bytes(),
                None => stored,
            },
            Other::Broken => match text.rfind('}') {
                Some(end) => format!(r#"{},"x":tru}}"#, &text[..end]).into_bytes(),
                None => stored,
            },
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
        /// A proxy that reads again a document it wrote, after other writers changed it in
        /// any way, writes, answers and snapshots exactly what a whole parse gives.
        #[test]
        fn a_resumed_parse_gives_what_a_whole_parse_gives(
            stored_ids in proptest::collection::btree_set(0u8..8, 0..4),
            rounds in proptest::collection::vec(
                (proptest::collection::vec((0u64..5, proptest::collection::vec(message(), 0..3)), 1..3),
                 proptest::collection::vec(other(), 0..3)),
                1..6),
        ) {
            let messages: Vec<Value> = stored_ids.iter().map(|i| json!({"id": format!("m-{i}"), "turn": 1, "content": "c"})).collect();
            let mut stored = serde_json::to_vec(&json!({"session": "s-1", "turn": 1, "version": 4,
                "messages": messages, "state": {}})).unwrap_or_default();
            let (mut mine, mut theirs) = (DigestCache::default(), DigestCache::default());
            for (appends, others) in &rounds {
                let (written, _) = batch_both_ways(&stored, appends, &mut mine);
                stored = written;
                for o in others {
                    stored = apply_other(stored, o, &mut theirs);
                }
            }
        }
    }

    /// Between two batches of this proxy, other proxies only appended: the second parse
    /// resumes, and gives what a whole parse gives.
    #[test]
    fn a_document_others_appended_to_is_resumed() {
        let messages: Vec<Value> = (0..300)
            .map(|i| json!({"id": format!("m-{i}"), "content": "c"}))
            .collect();
        let mut stored = serde_json::to_vec(&json!({"session": "s-1", "turn": 1, "version": 4, "messages": messages}))
            .unwrap_or_default();
        let (mut mine, mut theirs) = (DigestCache::default(), DigestCache::default());
        let mut resumed = Vec::new();
        for round in 0..4 {
            let (written, was) = batch_both_ways(&stored, &[(1, vec![json!({"id": format!("a-{round}")})])], &mut mine);
            resumed.push(was);
            stored = apply_other(
                written,
                &Other::Appends(vec![json!({"id": format!("b-{round}")})]),
                &mut theirs,
            );
            stored = apply_other(
                stored,
                &Other::Appends(vec![json!({"id": format!("c-{round}")})]),
                &mut DigestCache::default(),
            );
        }
        assert_eq!(resumed, [false, true, true, true]);
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
