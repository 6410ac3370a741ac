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
//! ```

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
    pub mode: Mode,
}

/// A path with one `{session}` segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    segments: Vec<Segment>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Session,
}

#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    #[error("cannot read routes file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("invalid routes file {path}: {reason}")]
    Invalid { path: String, reason: String },
}

impl Template {
    pub fn parse(raw: &str) -> Result<Self, String> {
        if !raw.starts_with('/') {
            return Err(format!("path {raw:?} must start with '/'"));
        }
        let segments: Vec<Segment> = raw
            .trim_end_matches('/')
            .split('/')
            .skip(1)
            .map(|s| match s {
                "{session}" => Segment::Session,
                lit => Segment::Literal(lit.to_owned()),
            })
            .collect();
        if segments.iter().filter(|s| **s == Segment::Session).count() != 1 {
            return Err(format!("path {raw:?} must contain exactly one {{session}} segment"));
        }
        Ok(Self { segments })
    }

    /// The raw session segment, when `path` matches.
    pub fn matches<'a>(&self, path: &'a str) -> Option<&'a str> {
        let mut parts = path.strip_prefix('/')?.split('/');
        let mut session = None;
        for seg in &self.segments {
            let part = parts.next()?;
            match seg {
                Segment::Literal(lit) if lit == part => {}
                Segment::Literal(_) => return None,
                Segment::Session => session = Some(part),
            }
        }
        if parts.next().is_some() {
            return None;
        }
        session
    }

    /// The path for one session.
    pub fn render(&self, session: &str) -> String {
        let mut out = String::new();
        for seg in &self.segments {
            out.push('/');
            match seg {
                Segment::Literal(lit) => out.push_str(lit),
                Segment::Session => out.push_str(session),
            }
        }
        out
    }
}

/// The configured write routes, matched in order.
#[derive(Clone, Debug)]
pub struct Routes {
    routes: Vec<Route>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    session_prefix: Option<String>,
    #[serde(default)]
    route: Vec<FileRoute>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRoute {
    method: String,
    path: String,
    turn: FileTurn,
    mode: String,
    kind: Option<Kind>,
    document: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTurn {
    body: Option<String>,
    header: Option<String>,
}

impl Routes {
    /// The canonical API under `prefix`.
    pub fn canonical(prefix: &str) -> Result<Self, String> {
        let prefix = prefix.trim_end_matches('/');
        let doc = Template::parse(&format!("{prefix}/{{session}}"))?;
        let body = || TurnSource::Body("/turn".into());
        let merge = |kind| Mode::Merge {
            kind,
            document: doc.clone(),
        };
        Ok(Self {
            routes: vec![
                Route {
                    name: "append",
                    method: Method::POST,
                    path: Template::parse(&format!("{prefix}/{{session}}/messages"))?,
                    turn: body(),
                    mode: merge(Kind::Append),
                },
                Route {
                    name: "compact",
                    method: Method::POST,
                    path: Template::parse(&format!("{prefix}/{{session}}/compact"))?,
                    turn: body(),
                    mode: merge(Kind::Compact),
                },
                Route {
                    name: "patch",
                    method: Method::PATCH,
                    path: doc.clone(),
                    turn: body(),
                    mode: merge(Kind::Patch),
                },
                Route {
                    name: "put",
                    method: Method::PUT,
                    path: doc.clone(),
                    turn: body(),
                    mode: merge(Kind::Put),
                },
                Route {
                    name: "delete",
                    method: Method::DELETE,
                    path: doc.clone(),
                    turn: body(),
                    mode: merge(Kind::Delete),
                },
            ],
        })
    }

    /// The canonical API plus the routes of a TOML file (file routes match first).
    pub fn from_file(path: &str, default_prefix: &str) -> Result<Self, RoutesError> {
        let text = std::fs::read_to_string(path).map_err(|source| RoutesError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, default_prefix).map_err(|reason| RoutesError::Invalid {
            path: path.to_owned(),
            reason,
        })
    }

    pub fn from_toml(text: &str, default_prefix: &str) -> Result<Self, String> {
        let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
        let prefix = file.session_prefix.as_deref().unwrap_or(default_prefix);
        let mut routes = Vec::new();
        for (i, r) in file.route.into_iter().enumerate() {
            let at = |msg: String| format!("route #{}: {msg}", i + 1);
            let method = Method::from_bytes(r.method.to_ascii_uppercase().as_bytes())
                .map_err(|_| at(format!("invalid method {:?}", r.method)))?;
            let path = Template::parse(&r.path).map_err(at)?;
            let turn = match (r.turn.body, r.turn.header) {
                (Some(p), None) if p.is_empty() || p.starts_with('/') => TurnSource::Body(p),
                (None, Some(h)) => TurnSource::Header(
                    http::HeaderName::from_bytes(h.as_bytes()).map_err(|_| at(format!("invalid header name {h:?}")))?,
                ),
                _ => {
                    return Err(at(
                        "turn must be exactly one of { body = \"/json/pointer\" } or { header = \"Name\" }".into(),
                    ))
                }
            };
            let mode = match r.mode.as_str() {
                "serialize" => Mode::Serialize,
                "merge" => {
                    let kind = r
                        .kind
                        .ok_or_else(|| at("mode \"merge\" needs kind = append|patch|put|compact|delete".into()))?;
                    let document = match r.document {
                        Some(d) => Template::parse(&d).map_err(at)?,
                        None => path.clone(),
                    };
                    Mode::Merge { kind, document }
                }
                other => return Err(at(format!("mode must be \"merge\" or \"serialize\", not {other:?}"))),
            };
            routes.push(Route {
                name: "custom",
                method,
                path,
                turn,
                mode,
            });
        }
        routes.extend(Self::canonical(prefix)?.routes);
        Ok(Self { routes })
    }

    /// The write route for a request, with its raw session segment.
    pub fn find<'a>(&self, method: &Method, path: &'a str) -> Option<(&Route, &'a str)> {
        self.routes
            .iter()
            .filter(|r| r.method == *method)
            .find_map(|r| r.path.matches(path).map(|s| (r, s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_routes_match_the_session_api() {
        let routes = Routes::canonical("/v1/sessions").unwrap();
        let (r, s) = routes.find(&Method::POST, "/v1/sessions/s-1/messages").unwrap();
        assert_eq!((r.name, s), ("append", "s-1"));
        assert_eq!(routes.find(&Method::PUT, "/v1/sessions/s-1").unwrap().0.name, "put");
        assert_eq!(routes.find(&Method::PATCH, "/v1/sessions/s-1").unwrap().0.name, "patch");
        assert_eq!(
            routes.find(&Method::POST, "/v1/sessions/s-1/compact").unwrap().0.name,
            "compact"
        );
        assert!(routes.find(&Method::GET, "/v1/sessions/s-1").is_none());
        assert!(routes.find(&Method::POST, "/v1/sessions/s-1/messages/x").is_none());
        assert!(routes.find(&Method::PUT, "/v2/sessions/s-1").is_none());
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
        let (r, s) = routes.find(&Method::POST, "/threads/t9/events").unwrap();
        assert_eq!((r.mode.clone(), s), (Mode::Serialize, "t9"));
        let (r, _) = routes.find(&Method::POST, "/docs/d1/add").unwrap();
        match &r.mode {
            Mode::Merge { kind, document } => {
                assert_eq!(*kind, Kind::Append);
                assert_eq!(document.render("d1"), "/docs/d1");
            }
            other => panic!("unexpected mode {other:?}"),
        }
        assert!(routes.find(&Method::POST, "/ctx/s/messages").is_some());
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
                "mode must be",
            ),
            ("bogus = 1", "unknown field"),
        ] {
            let err = Routes::from_toml(toml, "/v1/sessions").unwrap_err();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
    }
}
