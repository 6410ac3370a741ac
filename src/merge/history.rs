//! Version snapshots kept as chains. A batch of appends changes no stored message: the
//! snapshot of the version it writes is the previous version's plus what it appended. Such
//! a version's record holds only that (a [`Link`] to the previous version, the appended
//! messages' ids and digests, and every field's digests), so a growing document's record costs
//! what its batch appended, not what the document holds. Every [`CHAIN`]th version, every
//! version written by any other batch, every version of a document of fewer than
//! [`MIN_MESSAGES`] messages, and every version whose previous version has no record (written
//! past turnlock, or its record lost) is stored whole: a chain is never longer than that.
//!
//! A link names the messages of the version it follows by a fingerprint of their digests:
//! a document changed behind turnlock's back (a writer that kept its `version`) no longer
//! matches the chain, and a chain with a missing, expired or mismatched link gives no
//! snapshot, so a merged `PUT` based on that version is refused as based on an unknown
//! version, never merged against a wrong base.

use std::time::Duration;

use sha2::{Digest, Sha256};

use super::Snapshot;

/// A whole snapshot is stored at least every this many versions.
pub const CHAIN: u64 = 16;

/// Documents of fewer stored messages keep whole snapshots: their records are small anyway,
/// and a link costs a check that the previous version's record is there.
pub const MIN_MESSAGES: usize = 256;

/// How long a write-back's snapshot waits to learn whether the previous version's record is
/// there before it is stored whole instead.
pub const LOOKUP_WAIT: Duration = Duration::from_millis(50);

/// How long the previous version's record must still have to live for a link to follow it:
/// the link's release renews the chain below it after the write-back, and a record that
/// expired meanwhile would break the chain. Half the records' lifetime, at most 30 s.
pub fn renewal_margin(ttl: Duration) -> Duration {
    (ttl / 2).min(Duration::from_secs(30))
}

/// What a chained record follows: the previous version, and the fingerprint of its messages.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Link {
    pub version: u64,
    pub fingerprint: String,
}

/// Whether the snapshot of `version` may be stored as a link to the previous version's (the
/// batch appended only; the previous version is one turnlock wrote). Otherwise it is whole.
pub fn may_chain(version: u64) -> bool {
    version > 1 && version % CHAIN != 0
}

/// The versions whose records a link at `version` needs (newest first): the previous ones down
/// to the chain's whole snapshot at the most. Their lifetimes are renewed with the link's, so
/// a version's snapshot lives as long as a whole one would.
pub fn chain_below(version: u64) -> impl Iterator<Item = u64> {
    let whole = (version - version % CHAIN).max(1);
    (whole..version).rev()
}

/// The fingerprint of a list of message digests, fed one digest at a time.
#[derive(Clone, Default)]
pub struct Fingerprint(Sha256);

impl Fingerprint {
    pub fn add(&mut self, digest: &str) {
        self.0.update(digest.as_bytes());
        self.0.update([b'\n']);
    }

    pub fn value(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(32);
        for b in &self.0.clone().finalize()[..16] {
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0xf)] as char);
        }
        out
    }
}

/// A snapshot from the records of one chain, newest first: a whole snapshot last, each link
/// naming the version below it and that version's fingerprint. `None` when the chain is
/// broken (a record missing or of another version, a fingerprint that does not match) or
/// longer than [`CHAIN`].
pub fn assemble(mut newest_first: Vec<Snapshot>) -> Option<Snapshot> {
    if newest_first.len() > CHAIN as usize {
        return None;
    }
    let mut whole = newest_first.pop()?;
    if whole.after.is_some() {
        return None;
    }
    let mut fingerprint = Fingerprint::default();
    for d in &whole.message_digests {
        fingerprint.add(d);
    }
    while let Some(link) = newest_first.pop() {
        let after = link.after?;
        if after.version != whole.version
            || link.version != whole.version + 1
            || after.fingerprint != fingerprint.value()
            || link.message_ids.len() != link.message_digests.len()
        {
            return None;
        }
        for d in &link.message_digests {
            fingerprint.add(d);
        }
        whole.version = link.version;
        whole.field_digests = link.field_digests;
        whole.message_ids.extend(link.message_ids);
        whole.message_digests.extend(link.message_digests);
    }
    Some(whole)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn whole(version: u64, ids: &[&str]) -> Snapshot {
        Snapshot {
            version,
            field_digests: Map::new(),
            message_ids: ids.iter().map(|s| s.to_string()).collect(),
            message_digests: ids.iter().map(|s| format!("d-{s}")).collect(),
            after: None,
        }
    }

    fn link(below: &Snapshot, ids: &[&str]) -> Snapshot {
        let mut f = Fingerprint::default();
        below.message_digests.iter().for_each(|d| f.add(d));
        Snapshot {
            version: below.version + 1,
            after: Some(Link {
                version: below.version,
                fingerprint: f.value(),
            }),
            ..whole(below.version + 1, ids)
        }
    }

    #[test]
    fn a_chain_gives_the_whole_snapshot_of_its_newest_version() {
        let v3 = whole(3, &["a", "b"]);
        let v4 = link(&v3, &["c"]);
        let v4_whole = whole(4, &["a", "b", "c"]);
        let v5 = link(&v4_whole, &["d", "e"]);
        let got = assemble(vec![v5, v4, v3]).unwrap();
        assert_eq!(got, whole(5, &["a", "b", "c", "d", "e"]));
    }

    #[test]
    fn a_broken_chain_gives_nothing() {
        let v3 = whole(3, &["a", "b"]);
        let v4 = link(&v3, &["c"]);
        // A link that follows another content than the record below it holds (the document
        // was changed behind turnlock's back between the two writes).
        let v4_other = link(&whole(3, &["a", "x"]), &["c"]);
        assert_eq!(assemble(vec![v4_other, v3.clone()]), None);
        // A missing record in between.
        let v5 = link(&whole(4, &["a", "b", "c"]), &["d"]);
        assert_eq!(assemble(vec![v5.clone(), v3.clone()]), None);
        // No whole snapshot at the bottom.
        assert_eq!(assemble(vec![v5, v4.clone()]), None);
        assert_eq!(assemble(vec![]), None);
        assert_eq!(assemble(vec![v4, v3]).map(|s| s.version), Some(4));
    }

    #[test]
    fn chains_stay_short_and_renew_what_they_need() {
        assert!(!may_chain(1));
        assert!(may_chain(2));
        assert!(!may_chain(CHAIN));
        assert!(may_chain(CHAIN + 1));
        assert_eq!(
            chain_below(CHAIN + 3).collect::<Vec<_>>(),
            vec![CHAIN + 2, CHAIN + 1, CHAIN]
        );
        assert_eq!(chain_below(3).collect::<Vec<_>>(), vec![2, 1]);
        for v in 2..200 {
            if may_chain(v) {
                assert!(chain_below(v).count() < CHAIN as usize);
                assert!(!may_chain(chain_below(v).last().unwrap()) || chain_below(v).last() == Some(1));
            }
        }
    }
}
