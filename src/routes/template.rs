//! A route's path: literal segments, one `{session}` and other `{name}` placeholders (each
//! with literal text around it in its segment), matched against every reading of a request's
//! path and rendered back for the store.

use super::{normalize, Captures};

/// A path with one `{session}` (alone in its segment or with literal text around it, as in
/// `{session}.json`) and any other `{name}` segments, held normalized (see [`normalize`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    segments: Vec<Segment>,
    /// Configured with a trailing slash: kept when the path is rendered for the store.
    trailing_slash: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// `{session}`, with literal text before and after it in its segment.
    Session {
        prefix: String,
        suffix: String,
    },
    /// Another `{name}`, with literal text before and after it in its segment: its value
    /// captured.
    Param {
        name: String,
        prefix: String,
        suffix: String,
    },
}

impl Template {
    pub fn parse(raw: &str) -> Result<Self, String> {
        if !raw.starts_with('/') {
            return Err(format!("path {raw:?} must start with '/'"));
        }
        if raw.contains('?') || raw.contains('#') {
            return Err(format!(
                "path {raw:?} must not hold a query string or fragment: routes match the path only"
            ));
        }
        if !raw.is_ascii() {
            return Err(format!(
                "path {raw:?} holds non-ASCII text: write it percent-encoded, as it appears in a request"
            ));
        }
        if let Some(c) = raw.chars().find(|c| !is_path_char(*c)) {
            return Err(format!(
                "path {raw:?} holds {c:?}, which a request path cannot carry as is"
            ));
        }
        let trailing_slash = raw.len() > 1 && raw.ends_with('/');
        let body = if trailing_slash {
            &raw[1..raw.len() - 1]
        } else {
            &raw[1..]
        };
        let mut segments = Vec::new();
        for part in body.split('/') {
            let seg = normalize::decode_unreserved(part);
            if ["%2F", "%5C", ";"].iter().any(|c| seg.to_ascii_uppercase().contains(c)) {
                return Err(format!(
                    "path {raw:?}: {part:?} holds an encoded '/' or '\\' or a ';', which stores read as a separator or a parameter"
                ));
            }
            if let Some((prefix, rest)) = seg.split_once('{') {
                let Some((name, suffix)) = rest.split_once('}') else {
                    return Err(format!("path {raw:?}: {part:?} opens a placeholder it does not close"));
                };
                if [prefix, suffix].iter().any(|t| t.contains('{') || t.contains('}')) {
                    return Err(format!(
                        "path {raw:?}: {part:?} holds another placeholder beside {{{name}}} (one placeholder per segment)"
                    ));
                }
                if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(format!(
                        "path {raw:?}: {part:?} is not a placeholder: a name is letters, digits and '_'"
                    ));
                }
                let (prefix, suffix) = (prefix.to_owned(), suffix.to_owned());
                if name == "session" {
                    segments.push(Segment::Session { prefix, suffix });
                } else {
                    if segments
                        .iter()
                        .any(|s| matches!(s, Segment::Param { name: n, .. } if n == name))
                    {
                        return Err(format!("path {raw:?}: {{{name}}} appears twice"));
                    }
                    segments.push(Segment::Param {
                        name: name.to_owned(),
                        prefix,
                        suffix,
                    });
                }
            } else if seg.contains('}') {
                return Err(format!("path {raw:?}: {part:?} closes a placeholder it does not open"));
            } else if seg.is_empty() || seg == "." || seg == ".." {
                return Err(format!(
                    "path {raw:?} holds an empty or dot segment, which stores normalize away"
                ));
            } else {
                segments.push(Segment::Literal(seg));
            }
        }
        if segments.iter().filter(|s| matches!(s, Segment::Session { .. })).count() != 1 {
            return Err(format!("path {raw:?} must contain exactly one {{session}} segment"));
        }
        Ok(Self {
            segments,
            trailing_slash,
        })
    }

    /// The session and other placeholders, when these normalized segments are this template's.
    pub(super) fn matches(&self, parts: &[String]) -> Option<Captures> {
        self.matches_with(parts, |lit, part| lit == part)
    }

    /// Like [`Template::matches`], for a path read as it was sent
    /// ([`normalize::literal_readings`]): a trailing slash only where the route has one.
    pub(super) fn matches_literal(&self, parts: &[String]) -> Option<Captures> {
        let parts = if self.trailing_slash {
            parts.split_last().filter(|(last, _)| last.is_empty())?.1
        } else {
            parts
        };
        self.matches(parts)
    }

    /// Like [`Template::matches`], with literal text compared regardless of ASCII case,
    /// as case-insensitive routers (Express, ASP.NET Core, …) compare it.
    pub(super) fn matches_ignoring_case(&self, parts: &[String]) -> Option<Captures> {
        self.matches_with(parts, |lit, part| lit.eq_ignore_ascii_case(part))
    }

    fn matches_with(&self, parts: &[String], same: impl Fn(&str, &str) -> bool) -> Option<Captures> {
        if parts.len() != self.segments.len() {
            return None;
        }
        let mut session = None;
        let mut params = Vec::new();
        for (seg, part) in self.segments.iter().zip(parts) {
            match seg {
                Segment::Literal(lit) if same(lit, part) => {}
                Segment::Literal(_) => return None,
                Segment::Session { prefix, suffix } => {
                    session = Some(between(part, prefix, suffix, &same)?.to_owned());
                }
                Segment::Param { name, prefix, suffix } => {
                    params.push((name.clone(), between(part, prefix, suffix, &same)?.to_owned()));
                }
            }
        }
        session.map(|session| Captures { session, params })
    }

    /// The names of the placeholders other than `{session}`.
    pub(super) fn params(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Param { name, .. } => Some(name.as_str()),
            _ => None,
        })
    }

    /// Whether this template has a placeholder other than `{session}`.
    pub fn has_params(&self) -> bool {
        self.params().next().is_some()
    }

    /// The path for one session (a template with no other placeholder).
    pub fn render(&self, session: &str) -> String {
        self.render_with(&Captures {
            session: session.to_owned(),
            params: Vec::new(),
        })
    }

    /// The path for what a request matched: its session, and its other placeholders' values.
    pub fn render_with(&self, captures: &Captures) -> String {
        let mut out = String::new();
        for seg in &self.segments {
            out.push('/');
            match seg {
                Segment::Literal(lit) => out.push_str(lit),
                Segment::Session { prefix, suffix } => {
                    out.push_str(prefix);
                    out.push_str(&captures.session);
                    out.push_str(suffix);
                }
                Segment::Param { name, prefix, suffix } => {
                    out.push_str(prefix);
                    if let Some((_, v)) = captures.params.iter().find(|(n, _)| n == name) {
                        out.push_str(v);
                    }
                    out.push_str(suffix);
                }
            }
        }
        if self.trailing_slash {
            out.push('/');
        }
        out
    }

    /// The same path whatever the trailing slash: two routes that differ only by it are one.
    pub(super) fn same_path(&self, other: &Self) -> bool {
        self.segments == other.segments
    }
}

/// The non-empty text of `part` between `prefix` and `suffix`, compared with `same`.
fn between<'a>(part: &'a str, prefix: &str, suffix: &str, same: impl Fn(&str, &str) -> bool) -> Option<&'a str> {
    let (p, s) = (prefix.len(), suffix.len());
    if part.len() <= p + s {
        return None;
    }
    let head = part.get(..p)?;
    let tail = part.get(part.len() - s..)?;
    if !same(prefix, head) || !same(suffix, tail) {
        return None;
    }
    part.get(p..part.len() - s)
}

/// `pchar` and `/` of RFC 3986, plus the braces of the placeholder.
fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-._~!$&'()*+,;=:@%/{}".contains(c)
}
