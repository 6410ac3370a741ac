//! Request paths as a store may read them.
//!
//! Stores (and the frameworks in front of them) disagree on what a path means: most decode
//! percent-encoded unreserved characters, remove dot segments, collapse duplicate slashes and
//! ignore a trailing slash; some also read an encoded `/` or a `\` as a separator, or drop
//! `;params` from a segment. A write route must match every spelling a store could take for
//! it, or a write would reach the store without the lock. So a path is read in each of those
//! ways ([`readings`]); the router compares what each reading matches. Stores whose names are
//! literal (S3 keys, CouchDB ids) read a path as it is sent ([`literal_readings`]): for them
//! `a//b` or `a/./b` is another name, never the route's document.

use super::dialect::Names;

/// The segments of a path after RFC 3986 normalization: unreserved characters
/// percent-decoded (other escapes kept, hex upper-cased), empty segments (duplicate or
/// trailing slashes) dropped, and, when `resolve_dots`, dot segments resolved.
pub fn segments(path: &str, resolve_dots: bool) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for raw in path.split('/') {
        let seg = decode_unreserved(raw);
        match seg.as_str() {
            "" => {}
            "." if resolve_dots => {}
            ".." if resolve_dots => {
                out.pop();
            }
            _ => out.push(seg),
        }
    }
    out
}

/// Every way a store could split `path` into segments. The first reading is the standard
/// one (RFC 3986); the others are added only when the path holds something read differently.
pub fn readings(path: &str) -> Vec<Vec<String>> {
    let mut all = vec![segments(path, true)];
    let mut add = |reading: Vec<String>| {
        if !all.contains(&reading) {
            all.push(reading);
        }
    };
    let upper = path.to_ascii_uppercase();
    // A store that does not resolve dot segments (spelled `.` or `%2E`).
    if path.contains('.') || upper.contains("%2E") {
        add(segments(path, false));
    }
    // A store that decodes `%2F` (or reads `\` / `%5C`) as a separator.
    if upper.contains("%2F") || upper.contains("%5C") || path.contains('\\') {
        let split = replace_ci(&replace_ci(path, "%2F", "/"), "%5C", "/").replace('\\', "/");
        add(segments(&split, true));
        add(segments(&split, false));
    }
    // A store that drops `;params` from each segment (servlet containers).
    if path.contains(';') {
        let stripped: Vec<&str> = path.split('/').map(|s| s.split(';').next().unwrap_or("")).collect();
        let stripped = stripped.join("/");
        add(segments(&stripped, true));
        add(segments(&stripped, false));
    }
    all
}

/// The readings of `path` by a store whose names are literal (see [`Names`]): every segment
/// as sent, empty and dot segments and `;params` included, with its unreserved characters
/// decoded; then as the store's own rules read it.
pub fn literal_readings(path: &str, names: Names) -> Vec<Vec<String>> {
    let split = |path: &str| -> Vec<String> { path.split('/').map(decode_unreserved).collect() };
    match names {
        Names::Normalized | Names::CouchIds => {
            let segments = split(path.strip_prefix('/').unwrap_or(path));
            let mut all = vec![segments.clone()];
            if names == Names::CouchIds && segments.iter().any(String::is_empty) {
                // Apache CouchDB drops empty segments (`/db//d`, `/db/d/` and `//db/d` are
                // the document `d`)...
                all.push(segments.iter().filter(|s| !s.is_empty()).cloned().collect());
                // ...where pouchdb-server reads `/db//d` as the document `/d`: an empty
                // segment a `/` starting the next.
                let mut joined: Vec<String> = Vec::with_capacity(segments.len());
                let mut slashes = String::new();
                let last = segments.len() - 1;
                for (i, seg) in segments.into_iter().enumerate() {
                    if seg.is_empty() && i < last && !joined.is_empty() {
                        slashes.push_str("%2F");
                    } else {
                        joined.push(std::mem::take(&mut slashes) + &seg);
                    }
                }
                if !all.contains(&joined) {
                    all.push(joined);
                }
            }
            all
        }
        Names::S3Keys => {
            let rest = path.trim_start_matches('/');
            let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
            let mut segments = vec![decode_unreserved(bucket)];
            if rest.contains('/') {
                segments.extend(split(&replace_ci(key, "%2F", "/")));
            }
            vec![segments]
        }
    }
}

/// Characters pouchdb-server drops from a database name (it names a file after it), all of
/// them refused in a database name by Apache CouchDB.
const UNFILEABLE: [char; 8] = ['?', '<', '>', '\\', ':', '*', '|', '"'];

/// Escaped in a database name put back into a path: all but letters, digits and `-._~`.
const DB_NAME: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Other paths a CouchDB-compatible server may serve `path` as, besides the ways
/// [`literal_readings`] reads it: pouchdb-server serves `/_node/{node}/db/doc` as `/db/doc`
/// (a node's own databases in Apache CouchDB), and a database name holding a character a file
/// name cannot (`cdb%3A`: an illegal name to Apache CouchDB) as the name without it (`cdb`).
pub fn couch_aliases(path: &str) -> Vec<String> {
    let rest = path.trim_start_matches('/');
    let (first, tail) = rest.split_once('/').map_or((rest, None), |(f, t)| (f, Some(t)));
    let db = percent_encoding::percent_decode_str(first).decode_utf8_lossy();
    let mut aliases = Vec::new();
    if db == "_node" {
        if let Some((_node, after)) = tail.and_then(|t| t.split_once('/')) {
            aliases.push(format!("/{after}"));
        }
    }
    // pouchdb-server also drops a `/` (`%2F`) from a database name, which Apache CouchDB
    // keeps (the database `db/`): the two read such a path as two databases.
    let dropped = |c: &char| UNFILEABLE.contains(c) || *c == '/' || c.is_control();
    let mut db = db.into_owned();
    // It stores a name Windows reserves for a device (`con`, `lpt1`, `con.txt`) as `__con__`,
    // and one it cleans to nothing (`?`, `*`, `...`) as `____`: any `__name__` may be another
    // name to it...
    if let Some(inner) = db.strip_prefix("__").and_then(|d| d.strip_suffix("__")) {
        let inner = match inner {
            "" => "%3F".to_owned(),
            inner => percent_encoding::utf8_percent_encode(inner, DB_NAME).to_string(),
        };
        aliases.push(with_db(&inner, tail));
    }
    // ...and cuts a name to 255 bytes.
    if db.len() > 255 {
        let mut cut = 255;
        while !db.is_char_boundary(cut) {
            cut -= 1;
        }
        db.truncate(cut);
        aliases.push(with_db(
            &percent_encoding::utf8_percent_encode(&db, DB_NAME).to_string(),
            tail,
        ));
    }
    if db.chars().any(|c| dropped(&c)) || db.ends_with(['.', ' ']) {
        let kept: String = db.chars().filter(|c| !dropped(c)).collect();
        // ...and a name it cleans to nothing is its `____`.
        let kept = match kept.trim_end_matches(['.', ' ']) {
            "" => "____".to_owned(),
            kept => percent_encoding::utf8_percent_encode(kept, DB_NAME).to_string(),
        };
        aliases.push(with_db(&kept, tail));
    }
    aliases
}

/// A path: the database `db` (escaped) and what followed it.
fn with_db(db: &str, tail: Option<&str>) -> String {
    match tail {
        Some(tail) => format!("/{db}/{tail}"),
        None => format!("/{db}"),
    }
}

/// One spelling for every spelling of a name or path that stores read alike: each escape of
/// a character a path may carry as it is (unreserved, sub-delims, `:` and `@`: `%2A` is `*`,
/// `%41` is `A`) decoded, every other character escaped (`%2F`, `%20`, `%22`, `"`, `é`, …),
/// with upper-case hex; `/` stays a separator. Stores decode their paths (S3, CouchDB,
/// Express and most routers read `a%2A` and `a*`, `a%22` and `a"` as one name): the keys of a
/// session and of its documents are made from this, so two spellings of one document share
/// its lock, commit slot and turn mark. What is sent to the store keeps the request's own
/// spelling.
pub fn canonical_name(name: &str) -> std::borrow::Cow<'_, str> {
    let as_is = |c: u8| c.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/".contains(&c);
    if name.bytes().all(as_is) {
        return std::borrow::Cow::Borrowed(name);
    }
    let bytes = name.as_bytes();
    let mut out = String::with_capacity(name.len() + 8);
    let escape = |c: u8, out: &mut String| out.push_str(&format!("%{c:02X}"));
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let escaped = (c == b'%')
            .then(|| Some(hex(*bytes.get(i + 1)?)? * 16 + hex(*bytes.get(i + 2)?)?))
            .flatten();
        match escaped {
            Some(d) if as_is(d) && d != b'/' => {
                out.push(d as char);
                i += 3;
            }
            Some(d) => {
                escape(d, &mut out);
                i += 3;
            }
            None if as_is(c) => {
                out.push(c as char);
                i += 1;
            }
            None => {
                escape(c, &mut out);
                i += 1;
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Percent-decodes the unreserved characters (`A-Z a-z 0-9 - . _ ~`) of one segment; every
/// other escape stays encoded, with upper-case hex; a `%` not followed by two hex digits is
/// kept as it is.
pub fn decode_unreserved(seg: &str) -> String {
    if !seg.contains('%') {
        return seg.to_owned();
    }
    decode_where(seg, |c| {
        c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~')
    })
}

/// Percent-decodes the escapes of the characters `decoded` takes; every other escape stays,
/// with upper-case hex; a `%` not followed by two hex digits is kept as it is.
fn decode_where(seg: &str, decoded: impl Fn(u8) -> bool) -> String {
    let bytes = seg.as_bytes();
    let mut out = String::with_capacity(seg.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let c = h * 16 + l;
                if decoded(c) {
                    out.push(c as char);
                } else {
                    out.push('%');
                    out.push(bytes[i + 1].to_ascii_uppercase() as char);
                    out.push(bytes[i + 2].to_ascii_uppercase() as char);
                }
                i += 3;
                continue;
            }
        }
        out.push(bytes[i] as char);
        i += 1;
    }
    out
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn replace_ci(s: &str, needle: &str, with: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.to_ascii_uppercase().find(needle) {
        out.push_str(&rest[..at]);
        out.push_str(with);
        rest = &rest[at + needle.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segs(p: &str) -> Vec<String> {
        segments(p, true)
    }

    #[test]
    fn unreserved_escapes_are_decoded_and_others_kept() {
        assert_eq!(decode_unreserved("%6Dessages"), "messages");
        assert_eq!(decode_unreserved("%7e%2d%2E%5f"), "~-._");
        assert_eq!(decode_unreserved("a%2fb"), "a%2Fb");
        assert_eq!(decode_unreserved("a%20b"), "a%20b");
        assert_eq!(decode_unreserved("100%"), "100%");
        assert_eq!(decode_unreserved("%zz%4"), "%zz%4");
    }

    #[test]
    fn slashes_and_dot_segments_are_normalized() {
        let want = vec!["v1", "sessions", "s1", "messages"];
        for p in [
            "/v1/sessions/s1/messages",
            "/v1/sessions/s1/messages/",
            "/v1//sessions/s1/messages",
            "/v1/sessions/s1/%6Dessages",
            "/v1/./sessions/x/../s1/messages",
            "/v1/sessions/s1/%2E/messages",
            "/../v1/sessions/s1/messages",
        ] {
            assert_eq!(segs(p), want, "{p}");
        }
        assert_eq!(segments("/a/../b", false), vec!["a", "..", "b"]);
    }

    #[test]
    fn names_stores_read_alike_have_one_canonical_spelling() {
        assert_eq!(canonical_name("/db/a%2A%21%28x%29%3a%40"), "/db/a*!(x):@");
        assert_eq!(canonical_name("/db/a*"), canonical_name("/db/a%2a"));
        assert_eq!(canonical_name("/db/%61%2fb%20c%25"), "/db/a%2Fb%20c%25");
        assert_eq!(canonical_name("/db/100%"), "/db/100%25");
        assert_eq!(canonical_name("/db/100%25"), "/db/100%25");
        assert_eq!(canonical_name("/db/a\"b"), canonical_name("/db/a%22b"));
        assert_eq!(canonical_name("/db/é[x]"), "/db/%C3%A9%5Bx%5D");
        assert_eq!(canonical_name("/db/%c3%a9%5bx%5d"), "/db/%C3%A9%5Bx%5D");
    }

    #[test]
    fn literal_readings_keep_every_segment_as_sent() {
        let s3 = |p: &str| literal_readings(p, Names::S3Keys);
        assert_eq!(s3("/b/sessions//k.json"), [["b", "sessions", "", "k.json"]]);
        assert_eq!(s3("/b/k.json/"), [["b", "k.json", ""]]);
        assert_eq!(s3("/b/./x/../k;a=b"), [["b", ".", "x", "..", "k;a=b"]]);
        assert_eq!(s3("/b/%6B\\x"), [["b", "k\\x"]]);
        // In the key `%2F` is a `/`; slashes before the bucket are one; the bucket is one name.
        assert_eq!(s3("/b/a%2fb"), [["b", "a", "b"]]);
        assert_eq!(s3("///b/a"), [["b", "a"]]);
        assert_eq!(s3("/b%2Fa/c"), [["b%2Fa", "c"]]);
        assert_eq!(s3("/b"), [["b"]]);
        let couch = |p: &str| literal_readings(p, Names::CouchIds);
        assert_eq!(couch("/db/a%2fb"), [["db", "a%2Fb"]]);
        // Apache CouchDB drops empty segments; pouchdb-server joins them into the next id.
        assert_eq!(couch("/db/d/"), vec![vec!["db", "d", ""], vec!["db", "d"]]);
        assert_eq!(
            couch("/db//d"),
            vec![vec!["db", "", "d"], vec!["db", "d"], vec!["db", "%2Fd"]]
        );
        assert_eq!(
            couch("/db///d/"),
            vec![vec!["db", "", "", "d", ""], vec!["db", "d"], vec!["db", "%2F%2Fd", ""]]
        );
    }

    #[test]
    fn readings_cover_separators_and_params() {
        assert_eq!(readings("/a/b").len(), 1);
        let r = readings("/a/x%2Fy/c");
        assert!(r.contains(&vec!["a".into(), "x%2Fy".into(), "c".into()]));
        assert!(r.contains(&vec!["a".into(), "x".into(), "y".into(), "c".into()]));
        let r = readings("/a/b;v=1/c");
        assert!(r.contains(&vec!["a".into(), "b".into(), "c".into()]));
        let r = readings("/v1/sessions/%2e%2E/messages");
        assert!(r.contains(&vec!["v1".into(), "sessions".into(), "..".into(), "messages".into()]));
        let r = readings("/a\\b");
        assert!(r.contains(&vec!["a".into(), "b".into()]));
    }

    #[test]
    fn couch_aliases_are_the_paths_pouchdb_server_serves_a_path_as() {
        assert_eq!(couch_aliases("/db/d"), Vec::<String>::new());
        assert_eq!(couch_aliases("/_node/n@h/db/d"), ["/db/d"]);
        assert_eq!(couch_aliases("/db%2F/d"), ["/db/d"]);
        assert_eq!(couch_aliases("/db%3A/d"), ["/db/d"]);
        assert_eq!(couch_aliases("/__con__/d"), ["/con/d"]);
        assert_eq!(couch_aliases("/__LPT1.txt__/d"), ["/LPT1.txt/d"]);
        assert_eq!(couch_aliases("/__cons__/d"), ["/cons/d"]);
        assert_eq!(couch_aliases("/____/d"), ["/%3F/d"]);
        assert_eq!(couch_aliases("/%3F/d"), ["/____/d"]);
        assert_eq!(couch_aliases("/.../d"), ["/____/d"]);
        let long = "a".repeat(300);
        assert_eq!(
            couch_aliases(&format!("/{long}/d")),
            [format!("/{}/d", "a".repeat(255))]
        );
    }
}
