//! Reading again a document this proxy wrote last. On a hot session the proxies take turns, and
//! between two batches of one proxy the others only appended: the document read then holds,
//! byte for byte, the messages this proxy wrote, followed by the new ones. What was learnt of
//! those messages (their place, ids, cache keys, digests and fingerprint) is kept with the
//! bytes written ([`LastWrite`]), and the next read compares the message list with them (one
//! `memcmp`) and parses only the members around it and the messages after them. Anything
//! else (another member order, a message changed or removed, bytes that do not fit) is read
//! whole, as before: the result is the same either way, only its cost differs.

use std::borrow::Cow;
use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::value::RawValue;

use super::history::Fingerprint;

/// Top-level members in order: key, and value's bytes.
pub(super) type MemberList<'a> = Vec<(Cow<'a, str>, &'a [u8])>;

/// A document as this proxy last wrote it, and what it learnt of its messages.
pub(super) struct LastWrite {
    pub body: Bytes,
    /// Where the message list starts (past its `[`) and where its last message ends.
    pub list: Range<usize>,
    /// Each message's bytes in `body`.
    pub ranges: Vec<Range<usize>>,
    pub ids: Vec<Arc<str>>,
    pub keys: Vec<(u64, usize)>,
    /// The ids of the messages (not the compacted ones).
    pub index: HashSet<Arc<str>>,
    /// Each message's digest and the fingerprint of them all, when a snapshot was made.
    pub digests: Option<(Vec<Arc<str>>, Fingerprint)>,
}

/// A document read again, laid out around the messages it shares with a [`LastWrite`]: the
/// members before `messages` and after it (in order, values raw and checked), and the
/// messages that follow the shared ones.
pub(super) struct Resumed<'a> {
    pub before: MemberList<'a>,
    /// Where the shared messages are in the document read.
    pub shared_at: usize,
    pub added: Vec<&'a [u8]>,
    pub after: MemberList<'a>,
}

impl LastWrite {
    /// `doc` laid out around the messages it shares with this write, or `None` when it does
    /// not begin the same way (it is then read whole). Every byte of `doc` outside the shared
    /// messages is checked as JSON here, as a whole read would.
    pub fn resume<'a>(&self, doc: &'a [u8]) -> Option<Resumed<'a>> {
        let (before, start) = members_before_messages(doc)?;
        let shared = &self.body[self.list.clone()];
        let end = start.checked_add(shared.len())?;
        if doc.get(start..end)? != shared {
            return None;
        }
        let rest = &doc[end..];
        let at = skip_ws(rest, 0);
        // The shared messages are followed by more (`,`), or end the list (`]`); a list that
        // was empty is followed by its first message or its end.
        let (added, after_list) = match *rest.get(at)? {
            b',' if !self.ranges.is_empty() => {
                let (added, end) = parse_list(doc, end + at + 1)?;
                // `,]` is no list.
                (!added.is_empty()).then_some((added, end))?
            }
            b']' => (Vec::new(), end + at + 1),
            _ if self.ranges.is_empty() => parse_list(doc, end)?,
            _ => return None,
        };
        let after = members_after_list(doc, after_list)?;
        Some(Resumed {
            before,
            shared_at: start,
            added,
            after,
        })
    }
}

/// The members before `messages` (keys decoded, values checked) and where the message list
/// starts (past its `[`). `None` when the document is not an object, has no `messages`, or
/// its `messages` is not an array.
fn members_before_messages(doc: &[u8]) -> Option<(MemberList<'_>, usize)> {
    let mut members = MemberList::new();
    let mut i = skip_ws(doc, 0);
    if *doc.get(i)? != b'{' {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(doc, i);
        let key_end = skip_string(doc, i)?;
        let key: Cow<'_, str> = serde_json::from_slice(&doc[i..key_end]).ok()?;
        i = skip_ws(doc, key_end);
        if *doc.get(i)? != b':' {
            return None;
        }
        i = skip_ws(doc, i + 1);
        if key == "messages" {
            return (*doc.get(i)? == b'[').then_some((members, i + 1));
        }
        let value_end = skip_value(doc, i)?;
        let value = checked(&doc[i..value_end])?;
        put(&mut members, key, value);
        i = skip_ws(doc, value_end);
        if *doc.get(i)? != b',' {
            return None;
        }
        i += 1;
    }
}

/// The messages of a list from `at` (after its `[` or after a `,`) to its `]`, checked, and
/// where the list ends (past its `]`).
fn parse_list(doc: &[u8], at: usize) -> Option<(Vec<&[u8]>, usize)> {
    let rest = doc.get(at..)?;
    // Parsed as a list of its own: `[` and what follows.
    let mut text = Vec::with_capacity(rest.len() + 1);
    text.push(b'[');
    text.extend_from_slice(rest);
    let mut stream = serde_json::Deserializer::from_slice(&text).into_iter::<Vec<&RawValue>>();
    let list = stream.next()?.ok()?;
    let offsets: Vec<Range<usize>> = list.iter().map(|raw| within(&text, raw.get().as_bytes())).collect();
    let end = stream.byte_offset();
    drop(stream);
    // `text[1..]` is `doc[at..]`.
    let messages = offsets
        .into_iter()
        .map(|r| doc.get(at + r.start.checked_sub(1)?..at + r.end.checked_sub(1)?))
        .collect::<Option<_>>()?;
    Some((messages, at + end.checked_sub(1)?))
}

/// The members after the message list (from past its `]` to the object's end), checked;
/// `None` when there is anything but members and the end, or `messages` again.
fn members_after_list(doc: &[u8], at: usize) -> Option<MemberList<'_>> {
    let i = skip_ws(doc, at);
    match doc.get(i)? {
        b'}' => {
            return (skip_ws(doc, i + 1) == doc.len()).then(Vec::new);
        }
        b',' => {}
        _ => return None,
    }
    let rest = &doc[i + 1..];
    // Parsed as an object of its own: `{` and what follows.
    let mut text = Vec::with_capacity(rest.len() + 1);
    text.push(b'{');
    text.extend_from_slice(rest);
    let parsed: Vec<(String, Range<usize>)> = {
        let members: super::raw::Members<'_> = serde_json::from_slice(&text).ok()?;
        members
            .0
            .into_iter()
            .map(|(k, v)| (k.into_owned(), within(&text, v.get().as_bytes())))
            .collect()
    };
    let base = i + 1;
    let mut members = Vec::with_capacity(parsed.len());
    for (key, r) in parsed {
        if key == "messages" {
            return None;
        }
        let value = doc.get(base + r.start.checked_sub(1)?..base + r.end.checked_sub(1)?)?;
        members.push((Cow::Owned(key), value));
    }
    Some(members)
}

/// Adds a member, or replaces the value of one of the same key (the last one counts, in the
/// place of the first, as when parsed into a map).
pub(super) fn put<'a>(members: &mut MemberList<'a>, key: Cow<'a, str>, value: &'a [u8]) {
    match members.iter_mut().find(|(k, _)| *k == key) {
        Some(slot) => slot.1 = value,
        None => members.push((key, value)),
    }
}

/// A member's value as a whole read checks it: one JSON value, nothing around it.
fn checked(value: &[u8]) -> Option<&[u8]> {
    serde_json::from_slice::<&RawValue>(value).ok().map(|_| value)
}

/// Where `part` (a slice of `whole`) lies in `whole`.
fn within(whole: &[u8], part: &[u8]) -> Range<usize> {
    let start = (part.as_ptr() as usize).saturating_sub(whole.as_ptr() as usize);
    start..start + part.len()
}

fn skip_ws(doc: &[u8], mut i: usize) -> usize {
    while matches!(doc.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// Past the end of the string starting at `i` (its opening quote).
fn skip_string(doc: &[u8], i: usize) -> Option<usize> {
    if *doc.get(i)? != b'"' {
        return None;
    }
    let mut j = i + 1;
    loop {
        match *doc.get(j)? {
            b'"' => return Some(j + 1),
            b'\\' => j += 2,
            _ => j += 1,
        }
    }
}

/// Past the end of the value starting at `i`. Only finds where it ends: the caller checks it.
fn skip_value(doc: &[u8], i: usize) -> Option<usize> {
    match *doc.get(i)? {
        b'"' => skip_string(doc, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match *doc.get(j)? {
                    b'"' => {
                        j = skip_string(doc, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while !matches!(
                doc.get(j),
                None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            ) {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_before_the_messages_are_found_and_checked() {
        let doc = br#" { "a" : {"x":[1,"]}\""]} , "b\u0041":"s,\"}" ,"messages":[{"id":"m"}],"z":1}"#;
        let (before, start) = members_before_messages(doc).expect("found");
        let keys: Vec<&str> = before.iter().map(|(k, _)| &**k).collect();
        assert_eq!(keys, ["a", "bA"]);
        assert_eq!(before[0].1, br#"{"x":[1,"]}\""]}"#);
        assert_eq!(&doc[start..start + 4], br#"{"id"#);
        for bad in [
            &br#"{"a":tru,"messages":[]}"#[..],
            br#"{"a":1 "messages":[]}"#,
            br#"{"a":1}"#,
            br#"{"messages":{}}"#,
            br#"["messages"]"#,
            br#"{"a":"unterminated"#,
        ] {
            assert!(
                members_before_messages(bad).is_none(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn the_rest_of_a_list_and_the_members_after_it_are_checked() {
        let doc = br#"[{"id":"a"} , {"id":"b"}] , "t":1, "u":[2]}  "#;
        let (list, end) = parse_list(doc, 1).expect("list");
        assert_eq!(list, [&br#"{"id":"a"}"#[..], br#"{"id":"b"}"#]);
        let after = members_after_list(doc, end).expect("members");
        assert_eq!(after.len(), 2);
        assert_eq!(after[1].1, b"[2]");
        assert!(members_after_list(br#"] }x"#, 1).is_none());
        assert!(members_after_list(br#"],"messages":[]}"#, 1).is_none());
        assert!(members_after_list(br#"],"a":}"#, 1).is_none());
        assert!(parse_list(br#"[{"id":"a"},]"#, 1).is_none());
    }
}
