//! Which requests are writes, and how each is handled.
//!
//! With no routes file, the canonical API under the session prefix (default `/v1/sessions`)
//! is served. A routes file (TOML) adds other stores' write endpoints:
//!
//! ```toml
//! session_prefix = "/v1/sessions"   # optional
//!
//! [[route]]
//! method = "POST"
//! path = "/api/threads/{session}/events"
//! turn = { header = "X-Turn" }      # or { body = "/meta/turn" } (a JSON pointer)
//! mode = "serialize"                # forwarded unchanged under the lock
//!
//! [[route]]
//! method = "POST"
//! path = "/api/docs/{session}/append"
//! turn = { body = "/turn" }
//! mode = "merge"
//! kind = "append"                   # append | patch | put | compact
//! document = "/api/docs/{session}"  # where the document is read and written back
//!
//! [store]                           # the store's protocol (see `dialect`)
//! dialect = "s3"                    # http (default) | s3 | couchdb
//!
//! [[route]]                         # literal text around placeholders; {names} other than
//! method = "PUT"                    # {session} match their part of one segment
//! path = "/{bucket}/sessions/{session}.json"
//! mode = "merge"
//! kind = "put"
//! turn = { body = "/turn", optional = true }   # a write without a turn: no stale check
//!
//! [[route]]                         # one object per message, created once
//! method = "PUT"
//! path = "/{bucket}/session_{session}/agents/agent_{agent}/messages/message_{n}.json"
//! mode = "serialize"
//! turn = { header = "X-Session-Turn", optional = true }
//! once = ["/message_id", "/created_at"]   # a rewrite of a stored object must keep these
//! session_scope = ["bucket"]        # placeholders keying the session (default: all)
//! ```

pub mod dialect;
mod file;
mod normalize;
mod template;

pub use self::dialect::{AnswerForm, Dialect, DialectName, Names, VersionAt};
pub use self::file::Signing;
pub use self::normalize::canonical_name;
pub use self::template::Template;

use http::Method;
use serde::Deserialize;

/// What a write route does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Append,
    Patch,
    Put,
    Compact,
    /// Deletes the document, ordered with the writes (see the README's lifecycle).
    Delete,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Read-merge-write against the document at this path template.
    Merge { kind: Kind, document: Template },
    /// Forwarded unchanged, under the lock, after the stale check.
    Serialize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TurnSource {
    /// A JSON pointer into the body (`/turn`); the `X-Session-Turn` header is the fallback.
    Body(String),
    /// A request header.
    Header(http::HeaderName),
}

#[derive(Clone, Debug)]
pub struct Route {
    pub name: &'static str,
    pub method: Method,
    pub path: Template,
    pub turn: TurnSource,
    /// A write may carry no turn: it is then serialized and merged, with no stale-turn check.
    pub turn_optional: bool,
    pub mode: Mode,
    /// The protocol of the store behind this route.
    pub dialect: &'static Dialect,
    /// The body must be declared JSON (the canonical API); a store's own route also takes a
    /// JSON body sent as `application/octet-stream`, `binary/octet-stream` or untyped, as
    /// object-store SDKs send it.
    pub strict_content_type: bool,
    /// `serialize` routes of objects created once (one object per message): JSON pointers
    /// whose values a rewrite of a stored object must keep; any other write to a stored
    /// object is refused as a stale turn (see `proxy::pipeline::once`).
    pub once: Option<Vec<String>>,
    /// The placeholders that qualify the session's records (all of the path's by default):
    /// the objects of one session that differ in the others share its lock.
    pub session_scope: Option<Vec<String>>,
}

/// What a matched path holds: the session, and the values of the route's other `{names}`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Captures {
    pub session: String,
    pub params: Vec<(String, String)>,
}

impl Captures {
    /// The id turnlock keys the session's records with: the session itself when the route
    /// has no other placeholder, else the session qualified by a digest of their values, so
    /// `/{bucket}/…/{session}` in two buckets are two sessions.
    pub fn session_key(&self) -> String {
        self.session_key_within(None)
    }

    /// [`Captures::session_key`] qualified by the placeholders of `scope` only (all when
    /// `None`): with an empty scope, the session itself.
    pub fn session_key_within(&self, scope: Option<&[String]>) -> String {
        let params: Vec<&(String, String)> = self
            .params
            .iter()
            .filter(|(name, _)| scope.map_or(true, |s| s.iter().any(|n| n == name)))
            .collect();
        if params.is_empty() {
            return self.session.clone();
        }
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for (name, value) in params {
            h.update(name.as_bytes());
            h.update([0]);
            h.update(canonical_name(value).as_bytes());
            h.update([0]);
        }
        let digest: String = h.finalize()[..6].iter().map(|b| format!("{b:02x}")).collect();
        format!("{}.{digest}", self.session)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    #[error("cannot read routes file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("invalid routes file {path}: {reason}")]
    Invalid { path: String, reason: String },
}

/// A request path that stores could read as different writes (another route or another
/// session): refused rather than guessed, so no spelling of a write reaches the store unlocked.
#[derive(Debug, thiserror::Error)]
#[error("the path {path:?} is ambiguous: stores read it as different write routes or sessions; send it normalized")]
pub struct AmbiguousPath {
    pub path: String,
    /// The dialect of a route the path matched: the refusal is answered in its form.
    pub dialect: &'static Dialect,
}

/// The configured write routes, matched in order.
#[derive(Clone, Debug)]
pub struct Routes {
    routes: Vec<Route>,
    signing: Option<Signing>,
}

impl Routes {
    /// The body field by which a `POST` names the document it writes, and its dialect, when a
    /// `PUT` route's dialect has one ([`Dialect::named_in_body`]).
    pub fn named_in_body(&self) -> Option<(&'static str, &'static Dialect)> {
        self.routes
            .iter()
            .filter(|r| r.method == Method::PUT)
            .find_map(|r| Some((r.dialect.named_in_body?, r.dialect)))
    }

    /// Whether a route merges a client's full document three ways (`kind = "put"`): only
    /// such a write reads back the snapshot of the version its client read.
    pub fn has_merged_put(&self) -> bool {
        self.routes
            .iter()
            .any(|r| matches!(r.mode, Mode::Merge { kind: Kind::Put, .. }))
    }

    /// The canonical API under `prefix`.
    pub fn canonical(prefix: &str) -> Result<Self, String> {
        let prefix = prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return Err(
                "session_prefix must name at least one path segment (e.g. \"/v1/sessions\"): with \"/\" every \
                 single-segment PUT and PATCH would be a session write"
                    .into(),
            );
        }
        let doc = Template::parse(&format!("{prefix}/{{session}}"))?;
        let body = || TurnSource::Body("/turn".into());
        let merge = |kind| Mode::Merge {
            kind,
            document: doc.clone(),
        };
        Ok(Self {
            signing: None,
            routes: vec![
                Route {
                    name: "append",
                    method: Method::POST,
                    path: Template::parse(&format!("{prefix}/{{session}}/messages"))?,
                    turn: body(),
                    turn_optional: false,
                    dialect: &dialect::HTTP,
                    strict_content_type: true,
                    once: None,
                    session_scope: None,
                    mode: merge(Kind::Append),
                },
                Route {
                    name: "compact",
                    method: Method::POST,
                    path: Template::parse(&format!("{prefix}/{{session}}/compact"))?,
                    turn: body(),
                    turn_optional: false,
                    dialect: &dialect::HTTP,
                    strict_content_type: true,
                    once: None,
                    session_scope: None,
                    mode: merge(Kind::Compact),
                },
                Route {
                    name: "patch",
                    method: Method::PATCH,
                    path: doc.clone(),
                    turn: body(),
                    turn_optional: false,
                    dialect: &dialect::HTTP,
                    strict_content_type: true,
                    once: None,
                    session_scope: None,
                    mode: merge(Kind::Patch),
                },
                Route {
                    name: "put",
                    method: Method::PUT,
                    path: doc.clone(),
                    turn: body(),
                    turn_optional: false,
                    dialect: &dialect::HTTP,
                    strict_content_type: true,
                    once: None,
                    session_scope: None,
                    mode: merge(Kind::Put),
                },
                Route {
                    name: "delete",
                    method: Method::DELETE,
                    path: doc.clone(),
                    turn: body(),
                    turn_optional: false,
                    dialect: &dialect::HTTP,
                    strict_content_type: true,
                    once: None,
                    session_scope: None,
                    mode: merge(Kind::Delete),
                },
            ],
        })
    }

    /// How turnlock signs its own requests to the store, if it does.
    pub fn signing(&self) -> Option<&Signing> {
        self.signing.as_ref()
    }

    fn ambiguous(&self, path: &str, route: usize) -> AmbiguousPath {
        AmbiguousPath {
            path: path.to_owned(),
            dialect: self.routes.get(route).map_or(&dialect::HTTP, |r| r.dialect),
        }
    }

    /// The one route (and session) that the readings of `path` match with `matches`, among
    /// the routes `considered`; readings that match different writes are ambiguous.
    fn match_readings(
        &self,
        method: &Method,
        path: &str,
        readings: &[Vec<String>],
        matches: fn(&Template, &[String]) -> Option<Captures>,
        considered: impl Fn(&Route) -> bool,
    ) -> Result<Option<(usize, Captures)>, AmbiguousPath> {
        let mut found: Option<(usize, Captures)> = None;
        for reading in readings {
            let hit = self
                .routes
                .iter()
                .enumerate()
                .filter(|(_, r)| r.method == *method && considered(r))
                .find_map(|(i, r)| matches(&r.path, reading).map(|s| (i, s)));
            match (&found, hit) {
                (_, None) => {}
                (None, Some(h)) => found = Some(h),
                (Some(f), Some(h)) if *f == h => {}
                (Some((i, _)), Some(_)) => return Err(self.ambiguous(path, *i)),
            }
        }
        Ok(found)
    }

    /// The write route for a request, with its session segment (normalized).
    ///
    /// The path is read every way a store could read it ([`normalize::readings`]): when any
    /// reading is a write, the request is that write; when readings are different writes, the
    /// path is refused as ambiguous. Routes of a store whose names are literal match the
    /// path as it is sent ([`normalize::literal_readings`]), in its case.
    pub fn find(&self, method: &Method, path: &str) -> Result<Option<(&Route, Captures)>, AmbiguousPath> {
        let routes = || self.routes.iter().filter(|r| r.method == *method);
        if routes().next().is_none() {
            return Ok(None);
        }
        let mut found = None;
        // The routes of a file share its store's dialect.
        if let Some(names) = routes().map(|r| r.dialect.names).find(|n| *n != Names::Normalized) {
            let readings = normalize::literal_readings(path, names);
            found = self.match_readings(method, path, &readings, Template::matches_literal, |r| {
                r.dialect.names != Names::Normalized
            })?;
            // A path a CouchDB-compatible server may serve as a write route's (a node's path, a
            // database name it cleans): refused, as the lock would not be the document's.
            if names == Names::CouchIds {
                for alias in normalize::couch_aliases(path) {
                    let readings = normalize::literal_readings(&alias, names);
                    let hit = self.match_readings(method, &alias, &readings, Template::matches_literal, |r| {
                        r.dialect.names != Names::Normalized
                    })?;
                    if let Some((i, _)) = hit {
                        return Err(self.ambiguous(path, i));
                    }
                }
            }
            // CouchDB servers disagree on what an empty segment names (see
            // `normalize::literal_readings`): a path holding one that one of them reads as a
            // write is refused, rather than written to a document another would not name.
            if let (Names::CouchIds, Some((i, _))) = (names, &found) {
                if path.trim_start_matches('/').split('/').any(str::is_empty) || path.starts_with("//") {
                    return Err(self.ambiguous(path, *i));
                }
            }
        }
        if routes().any(|r| r.dialect.names == Names::Normalized) {
            let readings = normalize::readings(path);
            let normalizing = |r: &Route| r.dialect.names == Names::Normalized;
            let mut normal = self.match_readings(method, path, &readings, Template::matches, normalizing)?;
            if normal.is_none() {
                // A store whose router ignores case reads `/API/threads/…` as the route: a
                // write (not on stores whose names are literal, such as S3 keys).
                normal = self.match_readings(method, path, &readings, Template::matches_ignoring_case, normalizing)?;
            }
            found = match (found, normal) {
                (Some(a), Some(b)) if a != b => return Err(self.ambiguous(path, a.0)),
                (a, b) => a.or(b),
            };
        }
        Ok(found.and_then(|(i, s)| self.routes.get(i).map(|r| (r, s))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find<'a>(routes: &'a Routes, method: &Method, path: &str) -> Option<(&'a Route, String)> {
        routes
            .find(method, path)
            .expect("not ambiguous")
            .map(|(r, c)| (r, c.session))
    }

    #[test]
    fn every_spelling_of_a_canonical_write_matches_it() {
        let routes = Routes::canonical("/v1/sessions").unwrap();
        for path in [
            "/v1/sessions/s1/messages/",
            "/v1/sessions/s1/%6Dessages",
            "/v1//sessions/s1/messages",
            "/v1/sessions/%731/messages",
            "/v1/sessions/s1/./messages",
            "/v1/x/../sessions/s1/messages",
            "/v1/sessions/s1/messages;v=1",
        ] {
            let (r, s) = find(&routes, &Method::POST, path).unwrap_or_else(|| panic!("{path} did not match"));
            assert_eq!((r.name, s.as_str()), ("append", "s1"), "{path}");
        }
        assert_eq!(find(&routes, &Method::PUT, "/v1/sessions/s1/").unwrap().0.name, "put");
    }

    #[test]
    fn a_write_spelled_in_another_case_is_still_that_write() {
        let routes = Routes::canonical("/v1/sessions").unwrap();
        for path in ["/V1/Sessions/s1/MESSAGES", "/v1/SESSIONS/s1/Messages/"] {
            let (r, s) = find(&routes, &Method::POST, path).unwrap_or_else(|| panic!("{path} did not match"));
            assert_eq!((r.name, s.as_str()), ("append", "s1"), "{path}");
        }
        // The session id keeps its case: it is the store's key, not a literal of the route.
        let (_, s) = find(&routes, &Method::POST, "/V1/sessions/AbC/messages").unwrap();
        assert_eq!(s, "AbC");
    }

    #[test]
    fn a_route_holding_an_encoded_separator_is_refused() {
        for path in ["/api/{session}/a%2Fb", "/api/{session}/a%5cb", "/api/{session}/a;v=1"] {
            assert!(Template::parse(path).is_err(), "{path} was accepted");
        }
    }

    #[test]
    fn paths_read_as_different_writes_are_ambiguous() {
        let routes = Routes::canonical("/v1/sessions").unwrap();
        for path in ["/v1/sessions/a;b/messages", "/v1/sessions/s2%2F..%2Fs1/messages"] {
            assert!(routes.find(&Method::POST, path).is_err(), "{path}");
        }
        // Only one reading is a write: served as that write.
        let (_, s) = find(&routes, &Method::POST, "/v1/sessions/s1/x/..%2F..%2Fs2/messages").unwrap();
        assert_eq!(s, "s2");
        // A session segment with an encoded slash is a write either way: refused as such.
        assert!(routes.find(&Method::PUT, "/v1/sessions/a%2Fb").is_ok());
    }

    #[test]
    fn a_route_configured_with_a_trailing_slash_matches_its_own_path() {
        let toml =
            "[[route]]\nmethod='POST'\npath='/api/threads/{session}/events/'\nturn={header='X-Turn'}\nmode='serialize'";
        let routes = Routes::from_toml(toml, "/v1/sessions").unwrap();
        for path in [
            "/api/threads/t1/events/",
            "/api/threads/t1/events",
            "/api/threads/t1/%65vents",
        ] {
            assert_eq!(find(&routes, &Method::POST, path).unwrap().1, "t1", "{path}");
        }
        let doc = Template::parse("/docs/{session}/").unwrap();
        assert_eq!(doc.render("d1"), "/docs/d1/");
    }

    #[test]
    fn routes_file_mistakes_are_refused_at_load() {
        let route = |extra: &str| format!("[[route]]\nmethod='POST'\nturn={{header='X-Turn'}}\n{extra}");
        for (toml, needle) in [
            (route("path='/x/{session}?a=1'\nmode='serialize'"), "query string"),
            (
                route("path='/x/{session}/a{thread'\nmode='serialize'"),
                "does not close",
            ),
            (route("path='/x/{session}/a}b'\nmode='serialize'"), "does not open"),
            (
                route("path='/x/{session}/{a-b}'\nmode='serialize'"),
                "a name is letters",
            ),
            (
                route("path='/x/{session}/{thread}'\nmode='merge'\nkind='put'\ndocument='/y/{session}/{other}'"),
                "{other}",
            ),
            (
                route("path='/x/{session}'\nmode='serialize'\nonce=['created_at']"),
                "not a JSON pointer",
            ),
            (
                route("path='/x/{session}/{a}'\nmode='serialize'\nsession_scope=['b']"),
                "not a placeholder",
            ),
            (route("path='/x/{a}/{session}/{a}'\nmode='serialize'"), "appears twice"),
            (route("path='/x/{session}{b}'\nmode='serialize'"), "another placeholder"),
            ("[store]\ndialect='ftp'".to_owned(), "unknown variant `ftp`"),
            (route("path='/x/{session}/é'\nmode='serialize'"), "non-ASCII"),
            (
                route("path='/x/{session}'\nmode='serialize'\nkind='append'"),
                "`kind` and `document`",
            ),
            (
                route("path='/x/{session}'\nmode='serialize'\ndocument='/x/{session}'"),
                "`kind` and `document`",
            ),
            (route("path='/x//{session}'\nmode='serialize'"), "empty or dot segment"),
            (
                format!(
                    "{}\n{}",
                    route("path='/x/{session}'\nmode='serialize'"),
                    route("path='/x/{session}/'\nmode='serialize'")
                ),
                "already route #1",
            ),
            (
                "[[route]]\nmethod='POST'\npath='/x/{session}'\nturn={body=''}\nmode='serialize'".to_owned(),
                "not a JSON pointer",
            ),
            ("session_prefix = '/'".to_owned(), "session_prefix"),
        ] {
            let err = Routes::from_toml(&toml, "/v1/sessions").unwrap_err();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
    }

    #[test]
    fn canonical_routes_match_the_session_api() {
        let routes = Routes::canonical("/v1/sessions").unwrap();
        let (r, s) = find(&routes, &Method::POST, "/v1/sessions/s-1/messages").unwrap();
        assert_eq!((r.name, s.as_str()), ("append", "s-1"));
        assert_eq!(find(&routes, &Method::PUT, "/v1/sessions/s-1").unwrap().0.name, "put");
        assert_eq!(
            find(&routes, &Method::PATCH, "/v1/sessions/s-1").unwrap().0.name,
            "patch"
        );
        assert_eq!(
            find(&routes, &Method::POST, "/v1/sessions/s-1/compact").unwrap().0.name,
            "compact"
        );
        assert!(find(&routes, &Method::GET, "/v1/sessions/s-1").is_none());
        assert!(find(&routes, &Method::POST, "/v1/sessions/s-1/messages/x").is_none());
        assert!(find(&routes, &Method::PUT, "/v2/sessions/s-1").is_none());
    }

    #[test]
    fn routes_file_adds_serialize_and_merge_routes() {
        let toml = r#"
            session_prefix = "/ctx"
            [[route]]
            method = "post"
            path = "/threads/{session}/events"
            turn = { header = "X-Turn" }
            mode = "serialize"
            [[route]]
            method = "POST"
            path = "/docs/{session}/add"
            turn = { body = "/meta/turn" }
            mode = "merge"
            kind = "append"
            document = "/docs/{session}"
        "#;
        let routes = Routes::from_toml(toml, "/v1/sessions").unwrap();
        let (r, s) = find(&routes, &Method::POST, "/threads/t9/events").unwrap();
        assert_eq!((r.mode.clone(), s.as_str()), (Mode::Serialize, "t9"));
        let (r, _) = find(&routes, &Method::POST, "/docs/d1/add").unwrap();
        match &r.mode {
            Mode::Merge { kind, document } => {
                assert_eq!(*kind, Kind::Append);
                assert_eq!(document.render("d1"), "/docs/d1");
            }
            other => panic!("unexpected mode {other:?}"),
        }
        assert!(find(&routes, &Method::POST, "/ctx/s/messages").is_some());
    }

    #[test]
    fn literal_text_around_the_session_and_other_placeholders_match_one_segment() {
        let toml = r#"
            [store]
            dialect = "s3"
            [[route]]
            method = "PUT"
            path = "/{bucket}/sessions/{session}.json"
            mode = "merge"
            kind = "put"
            document = "/{bucket}/sessions/{session}.json"
            turn = { body = "/turn", optional = true }
        "#;
        let routes = Routes::from_toml(toml, "/v1/sessions").unwrap();
        let (r, c) = routes.find(&Method::PUT, "/b1/sessions/s-7.json").unwrap().unwrap();
        assert_eq!(c.session, "s-7");
        assert_eq!(c.params, vec![("bucket".to_owned(), "b1".to_owned())]);
        assert!(r.turn_optional);
        assert_eq!(r.dialect, &dialect::S3);
        let Mode::Merge { document, .. } = &r.mode else {
            panic!("not a merge route")
        };
        assert_eq!(document.render_with(&c), "/b1/sessions/s-7.json");
        // The same session id in another bucket is another session.
        let (_, other) = routes.find(&Method::PUT, "/b2/sessions/s-7.json").unwrap().unwrap();
        assert_ne!(c.session_key(), other.session_key());
        for path in [
            "/b1/sessions/.json",
            "/b1/sessions/s-7.txt",
            "/b1/x/s-7.json",
            "/sessions/s-7.json",
        ] {
            assert!(routes.find(&Method::PUT, path).unwrap().is_none(), "{path}");
        }
        // Read by the canonical routes as a session write too: refused, in S3's form.
        let ambiguous = routes.find(&Method::PUT, "/v1/sessions/s-7.json").unwrap_err();
        assert_eq!(ambiguous.dialect, &dialect::S3);
        // S3 keys are literal: another case, an empty, dot or `;` segment, a trailing slash
        // is another object, not this route's (its write would reach the route's object).
        for path in [
            "/b1/Sessions/s-7.JSON",
            "/b1/sessions//s-7.json",
            "/b1/sessions/s-7.json/",
            "/b1/sessions/./s-7.json",
            "/b1/x/../sessions/s-7.json",
            "/b1/sessions/s-7.json;a=b",
            "/b1//sessions/s-7.json",
        ] {
            assert!(routes.find(&Method::PUT, path).unwrap().is_none(), "{path}");
        }
        // An encoded `/` is a `/` in an S3 key; an escaped unreserved character is that character.
        let (_, c) = routes.find(&Method::PUT, "/b1/sessions%2Fs-7.json").unwrap().unwrap();
        assert_eq!(c.session, "s-7");
        let (_, c) = routes.find(&Method::PUT, "/b1/sessions/%73-7.json").unwrap().unwrap();
        assert_eq!(c.session, "s-7");
        // Slashes before the bucket are one (`//b1/…` is bucket b1); the bucket is one name.
        let (_, c) = routes.find(&Method::PUT, "//b1/sessions/s-7.json").unwrap().unwrap();
        assert_eq!((c.session.as_str(), c.params[0].1.as_str()), ("s-7", "b1"));
        assert!(routes.find(&Method::PUT, "/b1%2Fsessions/s-7.json").unwrap().is_none());
        // Literal text may surround any placeholder.
        let layout = "[[route]]\nmethod='PUT'\npath='/{bucket}/session_{session}/agents/agent_{agent}/agent.json'\nmode='merge'\nkind='put'\nturn={body='/turn',optional=true}";
        let routes = Routes::from_toml(layout, "/v1/sessions").unwrap();
        let (r, c) = routes
            .find(&Method::PUT, "/b/session_s1/agents/agent_a9/agent.json")
            .unwrap()
            .unwrap();
        assert_eq!(c.session, "s1");
        assert_eq!(c.params[1], ("agent".to_owned(), "a9".to_owned()));
        assert_eq!(r.path.render_with(&c), "/b/session_s1/agents/agent_a9/agent.json");
        assert!(routes
            .find(&Method::PUT, "/b/session_s1/agents/agent_/agent.json")
            .unwrap()
            .is_none());
        // Without other placeholders the key is the session itself.
        let plain = Captures {
            session: "s1".into(),
            params: vec![],
        };
        assert_eq!(plain.session_key(), "s1");
    }

    #[test]
    fn a_session_scope_keys_every_object_of_a_session_alike() {
        let layout = "[[route]]\nmethod='PUT'\npath='/{bucket}/session_{session}/agents/agent_{agent}/messages/message_{n}.json'\nmode='serialize'\nturn={header='X-Session-Turn',optional=true}\nonce=['/created_at']\nsession_scope=['bucket']";
        let routes = Routes::from_toml(layout, "/v1/sessions").unwrap();
        let key = |path: &str| {
            let (r, c) = routes.find(&Method::PUT, path).unwrap().unwrap();
            assert_eq!(r.once.as_deref(), Some(&["/created_at".to_owned()][..]));
            assert!(r.turn_optional);
            c.session_key_within(r.session_scope.as_deref())
        };
        let a = key("/b/session_s1/agents/agent_a/messages/message_1.json");
        assert_eq!(a, key("/b/session_s1/agents/agent_z/messages/message_9.json"));
        assert_ne!(a, key("/other/session_s1/agents/agent_a/messages/message_1.json"));
        assert_ne!(a, key("/b/session_s2/agents/agent_a/messages/message_1.json"));
    }

    /// Apache CouchDB reads `/db//d`, `/db/d/` and `//db/d` as the document `d`;
    /// pouchdb-server reads `/db//d` as `/d` (which `/db/%2Fd` names) and `/db/d/` as an
    /// attachment of `d`: such a path is refused as ambiguous, never written unlocked.
    #[test]
    fn a_couchdb_path_with_an_empty_segment_is_ambiguous() {
        let toml = "[store]\ndialect='couchdb'\n[[route]]\nmethod='PUT'\npath='/{db}/{session}'\nmode='merge'\nkind='put'\nturn={body='/turn',optional=true}";
        let routes = Routes::from_toml(toml, "/v1/sessions").unwrap();
        for path in ["/db//d", "/db/d/", "//db/d", "/db/d//", "/db///d/"] {
            let refused = routes.find(&Method::PUT, path).expect_err(path);
            assert_eq!(refused.dialect, &dialect::COUCHDB, "{path}");
        }
        for path in ["/db/%2Fd", "/db/%2fd"] {
            let (_, c) = routes
                .find(&Method::PUT, path)
                .unwrap()
                .unwrap_or_else(|| panic!("{path}"));
            assert_eq!(c.session, "%2Fd", "{path}");
        }
        assert!(routes.find(&Method::PUT, "/db/a/b").unwrap().is_none());
    }

    /// pouchdb-server serves `/_node/{node}/db/d` as `/db/d`, and `/db%3A/d` (a name Apache
    /// CouchDB refuses) as `/db/d`: refused rather than written under another lock, or none.
    #[test]
    fn a_couchdb_path_a_server_serves_as_a_documents_is_ambiguous() {
        for route in ["/{db}/{session}", "/sessions/{session}"] {
            let toml = format!("[store]\ndialect='couchdb'\n[[route]]\nmethod='PUT'\npath='{route}'\nmode='merge'\nkind='put'\nturn={{body='/turn',optional=true}}");
            let routes = Routes::from_toml(&toml, "/v1/sessions").unwrap();
            for path in [
                "/_node/node1@127.0.0.1/sessions/d",
                "/%5Fnode/_local/sessions/d",
                "/sessions%3A/d",
                "/sessions%2A%3F/d",
                "/sessions./d",
                "/sessions%20/d",
                "/%22sessions%22/d",
            ] {
                let refused = routes.find(&Method::PUT, path).expect_err(path);
                assert_eq!(refused.dialect, &dialect::COUCHDB, "{route} {path}");
            }
            assert!(routes.find(&Method::PUT, "/sessions/d").unwrap().is_some(), "{route}");
            assert!(routes.find(&Method::PUT, "/_node/n1").is_ok(), "{route}");
        }
        let toml = "[store]\ndialect='couchdb'\n[[route]]\nmethod='PUT'\npath='/sessions/{session}'\nmode='merge'\nkind='put'\nturn={body='/turn',optional=true}";
        let routes = Routes::from_toml(toml, "/v1/sessions").unwrap();
        // Another database, however spelled, is not the route's.
        for path in ["/other%3A/d", "/_node/n1/other/d", "/_users/org.couchdb.user:jan"] {
            assert!(routes.find(&Method::PUT, path).unwrap().is_none(), "{path}");
        }
    }

    /// A delete is ordered by the document's commit slot: its route names no turn.
    #[test]
    fn a_delete_route_needs_no_turn() {
        let routes = Routes::from_toml(
            "[[route]]\nmethod='DELETE'\npath='/db/{session}'\nmode='merge'\nkind='delete'",
            "/v1/sessions",
        )
        .expect("a delete route without a turn");
        let (route, _) = routes
            .find(&Method::DELETE, "/db/s1")
            .expect("unambiguous")
            .expect("matched");
        assert!(matches!(route.mode, Mode::Merge { kind: Kind::Delete, .. }));
    }

    #[test]
    fn invalid_routes_files_say_what_is_wrong() {
        for (toml, needle) in [
            (
                "[[route]]\nmethod='POST'\npath='/x'\nturn={body='/turn'}\nmode='serialize'",
                "{session}",
            ),
            (
                "[[route]]\nmethod='POST'\npath='/x/{session}'\nturn={}\nmode='serialize'",
                "turn must be",
            ),
            (
                "[[route]]\nmethod='POST'\npath='/x/{session}'\nturn={body='/t'}\nmode='merge'",
                "needs kind",
            ),
            (
                "[[route]]\nmethod='POST'\npath='/x/{session}'\nturn={body='/t'}\nmode='bogus'",
                "unknown variant `bogus`, expected `serialize` or `merge`",
            ),
            ("bogus = 1", "unknown field"),
            (
                "[[route]]\nmethod='POST'\npath='/x/{session}'\nturn={body='/t'}\nmode='merge'\nkind='append'\nbogus=1",
                "unknown field `bogus`",
            ),
            (
                "[[route]]\nmethod='POST'\npath='/x/{session}'\nturn={body='/t'}\nkind='append'",
                "missing field `mode`",
            ),
            (
                "[[route]]\nmethod='PUT'\npath='/x/{session}'\nmode='merge'\nkind='put'",
                "only kind = \"delete\" has none",
            ),
            // A read (or another write) that would delete the document.
            (
                "[[route]]\nmethod='GET'\npath='/x/{session}'\nmode='merge'\nkind='delete'",
                "route #1: kind = \"delete\" deletes the document: it is for method = \"DELETE\", not \"GET\"",
            ),
            (
                "[[route]]\nmethod='DELETE'\npath='/x/{session}'\nmode='merge'\nkind='put'\nturn={body='/t'}",
                "route #1: kind = \"put\" merges the request's body into the document: it is for a method that writes (POST, PUT, PATCH), not \"DELETE\"",
            ),
            (
                "[[route]]\nmethod='get'\npath='/x/{session}'\nmode='merge'\nkind='append'\nturn={body='/t'}",
                "not \"get\"",
            ),
            // A turn that would not be checked.
            (
                "[[route]]\nmethod='DELETE'\npath='/x/{session}'\nmode='merge'\nkind='delete'\nturn={header='X-Turn'}",
                "route #1: a delete route names no turn",
            ),
            (
                "[[route]]\nmethod='DELETE'\npath='/x/{session}'\nmode='serialize'\nkind='delete'",
                "route #1: mode \"serialize\" forwards the request unchanged",
            ),
            // A mistake in a later route names that route.
            (
                "[[route]]\nmethod='PUT'\npath='/x/{session}'\nmode='serialize'\nturn={header='T'}\n\
                 [[route]]\nmethod='PUT'\npath='/y/{session}'\nmode='serialize'",
                "route #2: a serialize route needs turn",
            ),
            (
                "[[route]]\nmethod='PUT'\npath='/x/{session}'\nmode='serialize'\nturn={header='T'}\n\
                 [[route]]\nmethod='PUT'\npath='/y/{session}'\nmode='merge'\nkind='put'\nturn={header='T'}\ndocumnet='/z/{session}'",
                "route #2: unknown field `documnet`",
            ),
        ] {
            let err = Routes::from_toml(toml, "/v1/sessions").unwrap_err();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
    }
}
