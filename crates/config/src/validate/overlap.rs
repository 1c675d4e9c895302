//! Routes that hide one another, or let requests around a route's policies: warned of, as
//! the file is valid and may mean it (nginx refuses two `location`s alike; Kong takes the
//! route that matches, methods included, as tollgate does).

use super::problems::Problems;
use crate::file::Route;

/// A route's match as written, for comparing routes.
struct Match<'a> {
    host: Option<String>,
    path: &'a str,
    exact: bool,
    any_case: bool,
    methods: Option<Vec<String>>,
}

impl<'a> Match<'a> {
    fn of(r: &'a Route) -> Option<Match<'a>> {
        let (path, exact) = match (&r.path_prefix, &r.path) {
            (Some(p), None) => (p.as_str(), false),
            (None, Some(p)) => (p.as_str(), true),
            _ => return None,
        };
        Some(Match {
            host: r.host.as_ref().map(|h| h.to_ascii_lowercase()),
            path,
            exact,
            any_case: r.case_insensitive,
            methods: r
                .methods
                .as_ref()
                .map(|m| m.iter().map(|m| m.to_ascii_uppercase()).collect()),
        })
    }

    /// Whether every request path and host `inner` matches, this matches too.
    fn covers(&self, inner: &Match<'_>) -> bool {
        if self.host.is_some() && self.host != inner.host {
            return false;
        }
        let starts = |s: &str, p: &str| {
            s.len() >= p.len()
                && if self.any_case {
                    s.as_bytes()[..p.len()].eq_ignore_ascii_case(p.as_bytes())
                } else {
                    s.starts_with(p)
                }
        };
        match (self.exact, inner.exact) {
            (true, true) => starts(inner.path, self.path) && inner.path.len() == self.path.len(),
            (true, false) => false,
            (false, _) => starts(inner.path, self.path),
        }
    }

    /// Whether the two match the same requests' paths and hosts.
    fn same(&self, other: &Match<'_>) -> bool {
        self.host == other.host
            && self.path == other.path
            && self.exact == other.exact
            && self.any_case == other.any_case
    }

    /// Whether this takes `method` (upper case): a route without a list takes all but
    /// `TRACE`, as the method filter does.
    fn takes(&self, method: &str) -> bool {
        match &self.methods {
            None => method != "TRACE",
            Some(list) => list.iter().any(|m| m == method),
        }
    }

    /// Whether this takes a method `other` does not.
    fn takes_more(&self, other: &Match<'_>) -> bool {
        match &self.methods {
            None => other.methods.is_some(),
            Some(mine) => mine.iter().any(|m| !other.takes(m)),
        }
    }
}

/// Warns of a route never used (another before it matches the same requests, methods
/// included), and of a route with policies whose requests for other methods fall to a
/// broader route without `auth`: they skip its key check, `allow` and limits, and its
/// key goes upstream unstripped.
pub(super) fn overlaps(routes: &[Route], p: &mut Problems) {
    let matches: Vec<Option<Match<'_>>> = routes.iter().map(Match::of).collect();
    let label = |j: usize| match &routes[j].name {
        Some(n) => format!("routes[{j}] ({n:?})"),
        None => format!("routes[{j}]"),
    };
    for (i, a) in matches.iter().enumerate() {
        let Some(a) = a else { continue };
        for (j, b) in matches.iter().enumerate().take(i) {
            let Some(b) = b else { continue };
            if b.same(a) && !a.takes_more(b) {
                p.warn(
                    format!("routes[{i}]"),
                    format!(
                        "never used: {} comes first and matches the same requests",
                        label(j)
                    ),
                );
                break;
            }
        }
        let r = &routes[i];
        let guarded = r.auth.is_some() || r.allow.is_some() || !r.limits.is_empty();
        if !guarded || a.methods.is_none() {
            continue;
        }
        // Some of its methods taken first by an open route on the same paths.
        let first = matches.iter().enumerate().take(i).find_map(|(j, b)| {
            let b = b
                .as_ref()
                .filter(|b| b.same(a) && routes[j].auth.is_none())?;
            let taken: Vec<&str> = a
                .methods
                .iter()
                .flatten()
                .map(String::as_str)
                .filter(|m| b.takes(m))
                .collect();
            (!taken.is_empty() && a.takes_more(b)).then_some((j, taken))
        });
        if let Some((j, taken)) = first {
            p.warn(
                format!("routes[{i}].methods"),
                format!(
                    "{} requests to {:?} go to {}, which comes first and has no `auth`: they skip this route's key check, `allow` and limits, and their key goes upstream",
                    taken.join(", "),
                    a.path,
                    label(j)
                ),
            );
        }
        let open = matches.iter().enumerate().find(|(j, b)| {
            *j != i
                && routes[*j].auth.is_none()
                && b.as_ref()
                    .is_some_and(|b| b.covers(a) && b.takes_more(a) && (!b.same(a) || *j > i))
        });
        if let Some((j, _)) = open {
            p.warn(
                format!("routes[{i}].methods"),
                format!(
                    "requests for other methods to {:?} go to {}, which has no `auth`: they skip this route's key check, `allow` and limits, and their key goes upstream; give them a route of their own",
                    a.path,
                    label(j)
                ),
            );
        }
    }
}
