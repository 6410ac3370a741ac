//! Session ids, turns and the keys built from them: the pure rules every write starts with.

use std::fmt;

/// Longest session id accepted, in bytes.
pub const MAX_SESSION_ID_LEN: usize = 128;

/// Largest turn accepted: the largest integer a JSON number holds exactly in every client.
pub const MAX_TURN: u64 = (1 << 53) - 1;

/// A validated session id.
///
/// Only `[A-Za-z0-9._-]` is allowed (and not `.` or `..` alone), so an id can never carry a
/// key separator (`:`), a Redis glob character (`*`, `?`, `[`), a path separator or an escape:
/// two different ids always build two different keys, and an id is safe in a URL path as is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(String);

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidSessionId {
    #[error("session id is empty")]
    Empty,
    #[error("session id is longer than {MAX_SESSION_ID_LEN} bytes")]
    TooLong,
    #[error("session id may only contain letters, digits, '.', '_' and '-' (found {0:?})")]
    BadChar(char),
    #[error("session id may not be '.' or '..'")]
    DotSegment,
}

impl SessionId {
    pub fn parse(raw: &str) -> Result<Self, InvalidSessionId> {
        if raw.is_empty() {
            return Err(InvalidSessionId::Empty);
        }
        if raw.len() > MAX_SESSION_ID_LEN {
            return Err(InvalidSessionId::TooLong);
        }
        if let Some(c) = raw
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(InvalidSessionId::BadChar(c));
        }
        if raw == "." || raw == ".." {
            return Err(InvalidSessionId::DotSegment);
        }
        Ok(Self(raw.to_owned()))
    }

    /// The id of a session a store names in its own way (an S3 key segment such as
    /// `tenant%3A42` or `alice smith`, a CouchDB document id): itself when it is a valid id,
    /// else `~` and a digest of the name. `~` never starts a valid id, so the two forms never
    /// meet, and a digest keeps the key free of separators and glob characters.
    pub fn of_store_name(raw: &str) -> Self {
        match Self::parse(raw) {
            Ok(id) => id,
            Err(_) => {
                use sha2::Digest;
                let digest = sha2::Sha256::digest(raw.as_bytes());
                Self(format!(
                    "~{}",
                    digest[..16].iter().map(|b| format!("{b:02x}")).collect::<String>()
                ))
            }
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a turn could not be read from a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TurnError {
    #[error("the write carries no turn: set the body field `turn` or the X-Session-Turn header")]
    Missing,
    #[error("turn must be a non-negative integer no larger than {MAX_TURN} (got {0})")]
    Invalid(String),
    #[error("the body field `turn` ({body}) and the X-Session-Turn header ({header}) disagree")]
    Mismatch { body: u64, header: u64 },
}

impl TurnError {
    pub fn code(&self) -> &'static str {
        match self {
            Self::Missing => "missing_turn",
            Self::Invalid(_) => "invalid_turn",
            Self::Mismatch { .. } => "turn_mismatch",
        }
    }
}

/// Reads a turn from a JSON value: a non-negative integer within [`MAX_TURN`].
pub fn turn_from_json(value: &serde_json::Value) -> Result<u64, TurnError> {
    match value.as_u64() {
        Some(t) if t <= MAX_TURN => Ok(t),
        _ => Err(TurnError::Invalid(truncate(&value.to_string(), 40))),
    }
}

/// Reads a turn from a header value: ASCII digits only, within [`MAX_TURN`].
pub fn turn_from_header(raw: &[u8]) -> Result<u64, TurnError> {
    let invalid = || TurnError::Invalid(truncate(&String::from_utf8_lossy(raw), 40));
    let text = std::str::from_utf8(raw).map_err(|_| invalid())?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid());
    }
    match text.parse::<u64>() {
        Ok(t) if t <= MAX_TURN => Ok(t),
        _ => Err(invalid()),
    }
}

/// Combines the body's and the header's turn: the body wins when only it has one, the header
/// is used when the body has none, and two different values are an error.
pub fn resolve_turn(body: Option<u64>, header: Option<u64>) -> Result<u64, TurnError> {
    match (body, header) {
        (Some(b), Some(h)) if b != h => Err(TurnError::Mismatch { body: b, header: h }),
        (Some(t), _) | (None, Some(t)) => Ok(t),
        (None, None) => Err(TurnError::Missing),
    }
}

/// The stale rule: a write whose turn is older than the stored turn is refused.
pub fn is_stale(write_turn: u64, stored_turn: u64) -> bool {
    write_turn < stored_turn
}

/// Builds the Redis keys turnlock uses, all under one configurable prefix.
///
/// Every key of a session carries the session id as a Redis Cluster hash tag (`{<id>}`), so
/// all keys one script touches share a slot. A [`SessionId`] cannot contain `:`, `{` or `}`,
/// so no id can alias another's key.
///
/// - `<prefix>session:{<id>}:<turn>`: the lock of one turn (shared by the session's documents);
/// - `<prefix>session:{<id>}:fence`: the fencing counter (monotonic, see `acquire.lua`);
/// - `<prefix>session:{<id>}:d<scope>:…`: the keys of one protected document (see [`Scope`]);
/// - `<prefix>session:{<id>}:idem:<digest>`: an idempotency record.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
    /// The store the documents live in, when a proxy serves several (transparent mode): two
    /// stores holding the same path are two documents.
    store: Option<String>,
}

impl Keys {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            store: None,
        }
    }

    /// The keys of the documents of one store among several (the same prefix; the lock keys
    /// and fencing counters stay the session's).
    pub fn for_store(&self, store: impl Into<String>) -> Self {
        Self {
            prefix: self.prefix.clone(),
            store: Some(store.into()),
        }
    }

    /// The lock for one turn of one session: `<prefix>session:{<id>}:<turn>`.
    pub fn lock(&self, session: &SessionId, turn: u64) -> String {
        format!("{}session:{{{}}}:{}", self.prefix, session, turn)
    }

    /// The channel a lock's release is announced on.
    pub fn released(&self, lock_key: &str) -> String {
        format!("{lock_key}:released")
    }

    /// The per-session fencing counter.
    pub fn fence_token(&self, session: &SessionId) -> String {
        format!("{}session:{{{}}}:fence", self.prefix, session)
    }

    /// The keys of one document (or serialized resource) of a session. `what` names what is
    /// protected: its path on the store. Two documents with one session id never share these
    /// keys.
    pub fn scope(&self, session: &SessionId, what: &str) -> Scope {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        if let Some(store) = &self.store {
            hasher.update(store.as_bytes());
            hasher.update(b" ");
        }
        hasher.update(what.as_bytes());
        let digest = hasher.finalize();
        let short: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        Scope {
            base: format!("{}session:{{{}}}:d{}", self.prefix, session, short),
        }
    }

    /// An idempotency record; the client's key is hashed, so it may hold any bytes. It shares
    /// the session's hash tag: the release stores it in the same script as the lock.
    pub fn idempotency(&self, session: &SessionId, key_digest: &str) -> String {
        format!("{}session:{{{}}}:idem:{}", self.prefix, session, key_digest)
    }
}

/// The Redis keys of one protected document: its commit slot, its turn mark (serialize mode)
/// and its version snapshots. All share the session's hash tag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    base: String,
}

impl Scope {
    /// The document's commit slot: held from the read to the store's answer, so commits of
    /// one document are ordered across turns and proxies (see `slot_take.lua`).
    pub fn slot(&self) -> String {
        format!("{}:slot", self.base)
    }

    /// The highest turn the store accepted in serialize mode (no document to read it from).
    pub fn turn_mark(&self) -> String {
        format!("{}:turn", self.base)
    }

    /// A snapshot of one version of the document, for three-way merges.
    pub fn history(&self, version: u64) -> String {
        format!("{}:history:{}", self.base, version)
    }
}

/// The Redis Cluster slot of a key: CRC16 (XMODEM) of its hash tag, or of the whole key when
/// it has none, modulo 16384.
pub fn cluster_slot(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter().position(|&b| b == b'}').map(|len| &rest[..len])
        })
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tag) % 16384
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stores_own_names_map_to_ids_that_never_meet_valid_ones() {
        assert_eq!(SessionId::of_store_name("s-1").as_str(), "s-1");
        let odd = SessionId::of_store_name("tenant%3A42");
        assert!(odd.as_str().starts_with('~') && odd.as_str().len() == 33, "{odd}");
        assert_ne!(odd, SessionId::of_store_name("tenant%3A43"));
        assert_eq!(odd, SessionId::of_store_name("tenant%3A42"));
        assert!(SessionId::parse(odd.as_str()).is_err());
        let long = "a".repeat(MAX_SESSION_ID_LEN + 1);
        assert!(SessionId::of_store_name(&long).as_str().starts_with('~'));
    }
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn ids_with_separators_globs_or_escapes_are_rejected() {
        for bad in [
            "a:b", "a*", "a?", "a[b]", "a/b", "..", ".", "a%2Fb", "é", "a b", "", "a\\b",
        ] {
            assert!(SessionId::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert_eq!(
            SessionId::parse(&"x".repeat(MAX_SESSION_ID_LEN + 1)),
            Err(InvalidSessionId::TooLong)
        );
    }

    #[test]
    fn ordinary_ids_are_accepted() {
        for good in ["s-42", "A.b_c-9", "...", "x".repeat(MAX_SESSION_ID_LEN).as_str()] {
            assert!(SessionId::parse(good).is_ok(), "{good:?} was rejected");
        }
    }

    #[test]
    fn turn_accepts_only_non_negative_integers() {
        assert_eq!(turn_from_json(&json!(7)), Ok(7));
        assert_eq!(turn_from_json(&json!(0)), Ok(0));
        for bad in [json!(-1), json!(1.5), json!("7"), json!(null), json!(1u64 << 60)] {
            assert!(turn_from_json(&bad).is_err(), "{bad} was accepted");
        }
        assert_eq!(turn_from_header(b" 12 "), Ok(12));
        for bad in [&b"-1"[..], b"1.0", b"", b"abc", b"99999999999999999999", b"+3"] {
            assert!(turn_from_header(bad).is_err());
        }
    }

    #[test]
    fn turn_in_body_and_header_must_agree() {
        assert_eq!(resolve_turn(Some(3), None), Ok(3));
        assert_eq!(resolve_turn(None, Some(4)), Ok(4));
        assert_eq!(resolve_turn(Some(5), Some(5)), Ok(5));
        assert_eq!(
            resolve_turn(Some(5), Some(6)),
            Err(TurnError::Mismatch { body: 5, header: 6 })
        );
        assert_eq!(resolve_turn(None, None), Err(TurnError::Missing));
    }

    #[test]
    fn stale_turn_is_strictly_older() {
        assert!(is_stale(4, 5));
        assert!(!is_stale(5, 5));
        assert!(!is_stale(6, 5));
    }

    #[test]
    fn two_stores_never_share_a_documents_keys() {
        let keys = Keys::new("tl:");
        let id = SessionId::parse("s1").unwrap();
        let a = keys
            .for_store("10.0.0.1:8080 a.example")
            .scope(&id, "/api/threads/s1/events");
        let b = keys
            .for_store("10.0.0.2:8080 a.example")
            .scope(&id, "/api/threads/s1/events");
        let c = keys
            .for_store("10.0.0.1:8080 b.example")
            .scope(&id, "/api/threads/s1/events");
        assert_ne!(a.slot(), b.slot());
        assert_ne!(a.turn_mark(), c.turn_mark());
        assert_eq!(
            keys.lock(&id, 3),
            keys.for_store("10.0.0.1:8080").lock(&id, 3),
            "the lock stays the session's"
        );
    }

    /// The slot Redis Cluster gives a key: CRC16-XMODEM of its hash tag (the text between the
    /// first `{` and the next `}`, when not empty) or of the whole key, modulo 16384. Written
    /// out here from the cluster specification, independent of any client library.
    fn spec_slot(key: &[u8]) -> u16 {
        let mut hashed = key;
        if let Some(open) = key.iter().position(|&b| b == b'{') {
            if let Some(len) = key[open + 1..].iter().position(|&b| b == b'}') {
                if len > 0 {
                    hashed = &key[open + 1..open + 1 + len];
                }
            }
        }
        let mut crc: u16 = 0;
        for &byte in hashed {
            crc ^= u16::from(byte) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc % 16384
    }

    proptest! {
        #[test]
        fn the_routing_slot_is_the_specifications(key in proptest::collection::vec(any::<u8>(), 0..40)) {
            prop_assert_eq!(super::cluster_slot(&key), spec_slot(&key));
        }
    }

    #[test]
    fn the_slot_function_matches_the_cluster_specification() {
        // Reference values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(spec_slot(b"123456789"), 0x31C3, "the CRC16 check value");
        assert_eq!(spec_slot(b"foo"), 12182);
        assert_eq!(spec_slot(b"{user1000}.following"), spec_slot(b"user1000"));
        assert_eq!(spec_slot(b"foo{}{bar}"), spec_slot(b"foo{}{bar}"));
        assert_ne!(
            spec_slot(b"foo{}{bar}"),
            spec_slot(b"bar"),
            "an empty tag hashes the whole key"
        );
        assert_eq!(spec_slot(b"foo{{bar}}zap"), spec_slot(b"{bar"));
    }

    proptest! {
        #[test]
        fn every_key_and_channel_of_a_session_shares_one_slot(
            prefix in "[A-Za-z0-9:._/-]{0,16}",
            id in "[A-Za-z0-9._-]{1,40}",
            store in proptest::option::of("[ -~]{0,24}"),
            doc in "/[ -~]{0,40}",
            turn in 0u64..=MAX_TURN,
            version in any::<u64>(),
            digest in "[0-9a-f]{1,64}",
        ) {
            let Ok(session) = SessionId::parse(&id) else { return Ok(()) };
            let base = Keys::new(prefix.clone());
            let keys = match &store {
                Some(s) => base.for_store(s.clone()),
                None => base,
            };
            let lock = keys.lock(&session, turn);
            let scope = keys.scope(&session, &doc);
            let all = [
                keys.released(&lock),
                keys.fence_token(&session),
                keys.idempotency(&session, &digest),
                scope.slot(),
                scope.turn_mark(),
                scope.history(version),
            ];
            let slot = spec_slot(lock.as_bytes());
            prop_assert_eq!(slot, spec_slot(session.as_str().as_bytes()), "the lock hashes by the id alone");
            for key in &all {
                prop_assert_eq!(spec_slot(key.as_bytes()), slot, "{} is in another slot than {}", key, lock);
            }
        }

        #[test]
        fn distinct_valid_ids_never_share_a_lock_key(a in "[A-Za-z0-9._:*?-]{1,12}", b in "[A-Za-z0-9._:*?-]{1,12}", ta in 0u64..100, tb in 0u64..100) {
            let keys = Keys::new("tl:");
            if let (Ok(ia), Ok(ib)) = (SessionId::parse(&a), SessionId::parse(&b)) {
                let ka = keys.lock(&ia, ta);
                let kb = keys.lock(&ib, tb);
                prop_assert_eq!(ka == kb, ia == ib && ta == tb);
                prop_assert!(!ka.contains(['*', '?', '[']));
            }
        }

        #[test]
        fn distinct_documents_never_share_a_scope(a in "/[a-z/]{1,12}", b in "/[a-z/]{1,12}") {
            let keys = Keys::new("tl:");
            let id = SessionId::parse("s1").unwrap();
            prop_assert_eq!(keys.scope(&id, &a) == keys.scope(&id, &b), a == b);
            prop_assert!(keys.scope(&id, &a).slot().starts_with("tl:session:{s1}:d"), "slot key shape");
        }

        #[test]
        fn header_turn_round_trips(t in 0u64..=MAX_TURN) {
            prop_assert_eq!(turn_from_header(t.to_string().as_bytes()), Ok(t));
        }
    }
}
