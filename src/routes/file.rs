//! The routes file (TOML): its shape, as serde types (a route's `mode` tags its own fields),
//! and how it becomes [`Routes`].

use http::Method;
use serde::Deserialize;

use super::{dialect::DialectName, Kind, Mode, Route, Routes, RoutesError, Template, TurnSource};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    session_prefix: Option<String>,
    #[serde(default)]
    store: FileStore,
    /// Each read on its own (as a [`FileRoute`]), so that its mistakes name it.
    #[serde(default)]
    route: Vec<toml::Value>,
}

/// `[store]`: the protocol of the store behind the file's routes.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileStore {
    #[serde(default)]
    dialect: DialectName,
    sigv4: Option<Signing>,
}

/// `[store] sigv4 = { region = "us-east-1" }`: turnlock signs its own requests to the store
/// (its read and its write-back) with AWS Signature Version 4.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Signing {
    pub region: String,
    #[serde(default = "Signing::s3")]
    pub service: String,
}

impl Signing {
    fn s3() -> String {
        "s3".into()
    }
}

/// One `[[route]]` of the routes file; `mode` says which kind, each with its own fields.
#[derive(Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
enum FileRoute {
    Serialize(SerializeRoute),
    Merge(MergeRoute),
}

/// `mode = "serialize"`: forwarded unchanged, under the lock, after the stale check.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SerializeRoute {
    method: String,
    path: String,
    /// Required; optional here only to refuse its absence after fields of the wrong mode.
    turn: Option<FileTurn>,
    /// Objects created once: the JSON pointers a rewrite of a stored object must keep.
    once: Option<Vec<String>>,
    session_scope: Option<Vec<String>>,
    /// Fields of mode "merge", read only to refuse them with a message that says so.
    kind: Option<toml::Value>,
    document: Option<toml::Value>,
}

/// `mode = "merge"`: read-merge-write of `document` (the route's own path by default).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MergeRoute {
    method: String,
    path: String,
    /// Required but for `kind = "delete"`, which carries no turn.
    turn: Option<FileTurn>,
    /// Required; optional here only to refuse its absence with the list of kinds.
    kind: Option<Kind>,
    document: Option<String>,
    session_scope: Option<Vec<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileTurn {
    body: Option<String>,
    header: Option<String>,
    /// A write without a turn is served (serialized and merged, no stale-turn check).
    #[serde(default)]
    optional: bool,
}

impl Routes {
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
        let dialect = file.store.dialect.dialect();
        let mut routes: Vec<Route> = Vec::new();
        for (i, r) in file.route.into_iter().enumerate() {
            let at = |msg: String| format!("route #{}: {msg}", i + 1);
            let r: FileRoute = r.try_into().map_err(|e: toml::de::Error| at(e.message().to_owned()))?;
            // A delete is ordered by the document's commit slot: it has no turn to name.
            let no_turn = FileTurn {
                body: Some("/turn".into()),
                ..FileTurn::default()
            };
            let (method, path, turn, session_scope) = match &r {
                FileRoute::Serialize(r) => {
                    if r.kind.is_some() || r.document.is_some() {
                        return Err(at(
                            "mode \"serialize\" forwards the request unchanged: `kind` and `document` belong to mode \"merge\""
                                .into(),
                        ));
                    }
                    let Some(turn) = &r.turn else {
                        return Err(at(
                            "a serialize route needs turn = { body = \"/json/pointer\" } or { header = \"Name\" }"
                                .into(),
                        ));
                    };
                    (&r.method, &r.path, turn, r.session_scope.clone())
                }
                FileRoute::Merge(r) => {
                    let delete = matches!(r.kind, Some(Kind::Delete));
                    if delete && !r.method.eq_ignore_ascii_case("DELETE") {
                        return Err(at(format!(
                            "kind = \"delete\" deletes the document: it is for method = \"DELETE\", not {:?}",
                            r.method
                        )));
                    }
                    // A read (or a delete) would become a write of its body.
                    let bodiless = ["GET", "HEAD", "DELETE", "OPTIONS", "TRACE", "CONNECT"];
                    if let (Some(kind), false) = (r.kind, delete) {
                        if bodiless.iter().any(|m| r.method.eq_ignore_ascii_case(m)) {
                            return Err(at(format!(
                                "kind = \"{}\" merges the request's body into the document: it is for a method that writes (POST, PUT, PATCH), not {:?}",
                                format!("{kind:?}").to_lowercase(),
                                r.method
                            )));
                        }
                    }
                    let turn = match (&r.turn, r.kind) {
                        (Some(_), Some(Kind::Delete)) => {
                            return Err(at(
                                "a delete route names no turn: a delete is ordered by the document's commit slot, whatever turn it names".into(),
                            ))
                        }
                        (Some(turn), _) => turn,
                        // Without a kind: refused below, with the list of kinds.
                        (None, Some(Kind::Delete) | None) => &no_turn,
                        (None, Some(_)) => {
                            return Err(at("a merge route needs turn = { body = \"/json/pointer\" } or { header = \"Name\" } (only kind = \"delete\" has none)".into()))
                        }
                    };
                    (&r.method, &r.path, turn, r.session_scope.clone())
                }
            };
            let raw_path = path.clone();
            let method = Method::from_bytes(method.to_ascii_uppercase().as_bytes())
                .map_err(|_| at(format!("invalid method {method:?}")))?;
            let path = Template::parse(path).map_err(at)?;
            let turn_optional = turn.optional;
            let turn = match (&turn.body, &turn.header) {
                (Some(p), None) if p.starts_with('/') => TurnSource::Body(p.clone()),
                (Some(p), None) => {
                    return Err(at(format!(
                        "turn body {p:?} is not a JSON pointer: it must start with '/', e.g. \"/turn\""
                    )))
                }
                (None, Some(h)) => TurnSource::Header(
                    http::HeaderName::from_bytes(h.as_bytes()).map_err(|_| at(format!("invalid header name {h:?}")))?,
                ),
                _ => {
                    return Err(at(
                        "turn must be exactly one of { body = \"/json/pointer\" } or { header = \"Name\" }".into(),
                    ))
                }
            };
            if let Some(name) = session_scope
                .iter()
                .flatten()
                .find(|n| !path.params().any(|p| p == n.as_str()))
            {
                return Err(at(format!(
                    "session_scope names {name:?}, which is not a placeholder of the route's path"
                )));
            }
            let mut once = None;
            let mode = match r {
                FileRoute::Serialize(r) => {
                    if let Some(p) = r.once.iter().flatten().find(|p| !p.starts_with('/')) {
                        return Err(at(format!(
                            "once holds {p:?}, which is not a JSON pointer: it must start with '/', e.g. \"/created_at\""
                        )));
                    }
                    once = r.once;
                    Mode::Serialize
                }
                FileRoute::Merge(r) => {
                    let kind = r
                        .kind
                        .ok_or_else(|| at("mode \"merge\" needs kind = append|patch|put|compact|delete".into()))?;
                    let document = match r.document {
                        Some(d) => Template::parse(&d).map_err(at)?,
                        None => path.clone(),
                    };
                    if let Some(name) = document.params().find(|n| !path.params().any(|p| p == *n)) {
                        return Err(at(format!(
                            "document holds {{{name}}}, which the route's path does not: its value would be unknown"
                        )));
                    }
                    Mode::Merge { kind, document }
                }
            };
            if let Some(j) = routes
                .iter()
                .position(|o| o.method == method && o.path.same_path(&path))
            {
                return Err(at(format!(
                    "{method} {:?} is already route #{} (a request matches one route only)",
                    raw_path,
                    j + 1
                )));
            }
            routes.push(Route {
                name: "custom",
                method,
                path,
                turn,
                turn_optional,
                mode,
                dialect,
                strict_content_type: false,
                once,
                session_scope,
            });
        }
        routes.extend(Self::canonical(prefix)?.routes);
        Ok(Self {
            routes,
            signing: file.store.sigv4,
        })
    }
}
