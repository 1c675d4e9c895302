//! Who calls: the API key comes from a header or a query parameter (names set per route),
//! identifies a consumer (one the config lists, or one the admin API manages), and is
//! removed before forwarding unless the route keeps it. On `jwt` routes a bearer token
//! names the consumer ([`super::jwt`]), beside or instead of a key. On `mtls` routes the
//! verified client certificate names the consumer instead: the first of its SAN entries
//! and subject CN that is a consumer's name. The consumer's name goes upstream in a header
//! that clients cannot forge.

use crate::clock::Clock;
use crate::exchange::{Parts, Refusal};
use crate::snapshot::{Route, Snapshot};
use http::header::AUTHORIZATION;
use http::uri::PathAndQuery;
use http::HeaderValue;
use smallvec::SmallVec;
use std::borrow::Cow;
use tollgate_config::AuthConfig;

/// Identifies the consumer (401 when the key is missing or unknown, 400 when the request
/// carries two different keys), removes every credential the route names from every place
/// it names, and sets the consumer header. Routes without `auth` pass with no consumer.
pub fn authenticate(
    snap: &Snapshot,
    route: &Route,
    parts: &mut Parts,
    client_names: Option<&[Box<str>]>,
    clock: &dyn Clock,
) -> Result<Option<usize>, Refusal> {
    let Some(auth) = route.cfg.auth.as_ref() else {
        return Ok(None);
    };
    if auth.mtls {
        let names = client_names.ok_or(Refusal::NoClientCert)?;
        // The first name that is a consumer; one whose plan this config lacks is
        // refused as such (503), not passed over for a later name.
        let mut found = None;
        for n in names {
            match snap.find_consumer(n) {
                Ok(Some(c)) => {
                    found = Some(c);
                    break;
                }
                Ok(None) => {}
                Err(r @ Refusal::UnknownPlan) => return Err(r),
                Err(_) => {}
            }
        }
        let consumer = found.ok_or(Refusal::UnknownClientCert)?;
        set_consumer(snap, auth, consumer, parts);
        return Ok(Some(consumer));
    }
    if let Some(jwt) = &route.jwt {
        let keys_too = !(auth.header.is_empty() && auth.query.is_empty());
        let bearer = super::jwt::bearer(parts)?;
        if let Some(value) = bearer {
            // Verified before `Authorization` goes: a token waiting for its key set is
            // checked again on the same request.
            let consumer =
                super::jwt::verify(snap, jwt, super::jwt::token_in(&value), parts, clock)?;
            if !jwt.cfg.forward_token {
                parts.headers.remove(AUTHORIZATION);
            }
            if keys_too && !auth.keep_credential {
                strip_keys(auth, parts);
            }
            set_consumer(snap, auth, consumer, parts);
            return Ok(Some(consumer));
        }
        // Whatever `Authorization` holds (a token, or another scheme the route does not
        // read), it goes upstream only where the route says so.
        if !jwt.cfg.forward_token {
            parts.headers.remove(AUTHORIZATION);
        }
        if !keys_too {
            return Err(Refusal::MissingToken { or_key: false });
        }
        return match by_key(snap, auth, parts) {
            Err(Refusal::MissingKey) => Err(Refusal::MissingToken { or_key: true }),
            other => other.map(Some),
        };
    }
    by_key(snap, auth, parts).map(Some)
}

/// Identifies the consumer by its API key (see [`authenticate`]).
fn by_key(snap: &Snapshot, auth: &AuthConfig, parts: &mut Parts) -> Result<usize, Refusal> {
    let mut key: Option<Cow<'_, str>> = None;
    for name in &auth.header {
        for v in parts.headers.get_all(name) {
            let k = v.to_str().map_err(|_| Refusal::UnknownKey)?;
            // An empty one is no key (a form or a script that left it blank): missing,
            // as Kong says it, unless another place holds one.
            if !k.is_empty() {
                one_key(&mut key, Cow::Borrowed(k))?;
            }
        }
    }
    // Where the credentials start in the query: stripped without matching names again.
    let mut in_query: SmallVec<[usize; 2]> = SmallVec::new();
    if let (false, Some(q)) = (auth.query.is_empty(), parts.uri.query()) {
        for (at, name, value) in params(q) {
            if is_credential(name, &auth.query) {
                in_query.push(at);
                if !value.is_empty() {
                    one_key(&mut key, percent_decode(value))?;
                }
            }
        }
    }
    let key = key.ok_or(Refusal::MissingKey)?;
    let consumer = identify(snap, key.as_bytes())?;

    if !auth.keep_credential {
        for name in &auth.header {
            parts.headers.remove(name);
        }
        if !in_query.is_empty() {
            strip_pieces(parts, &in_query);
        }
    }
    set_consumer(snap, auth, consumer, parts);
    Ok(consumer)
}

/// The consumer holding `key`: a listed one (unless the admin API deleted it, or put it
/// again after a deletion, or moved it to another plan), else one whose key the admin API
/// added (found by the key's digest, looked for only while the API manages any consumer).
fn identify(snap: &Snapshot, key: &[u8]) -> Result<usize, Refusal> {
    let listed = snap.config.consumers.by_key(key);
    if snap.roster.is_empty() {
        return listed.ok_or(Refusal::UnknownKey);
    }
    if let Some(i) = listed {
        match snap.roster.get(snap.consumer_name(i)) {
            None => return Ok(i),
            // Put again after a deletion, which revoked the config's keys: only a key the
            // API gave it (looked for below) names it.
            Some(m) if m.without_config_keys && !m.deleted => {}
            Some(m) => return snap.managed(&m, Some(i)),
        }
    }
    let m = snap
        .roster
        .by_digest(&tollgate_config::key_digest(key))
        .ok_or(Refusal::UnknownKey)?;
    snap.managed(&m, snap.config.consumers.find(&m.name))
}

/// Removes every API key the route names from every place it names (a request judged by
/// its token may carry one too).
fn strip_keys(auth: &AuthConfig, parts: &mut Parts) {
    for name in &auth.header {
        parts.headers.remove(name);
    }
    let at: SmallVec<[usize; 2]> = match (auth.query.is_empty(), parts.uri.query()) {
        (false, Some(q)) => params(q)
            .filter(|(_, name, _)| is_credential(name, &auth.query))
            .map(|(at, _, _)| at)
            .collect(),
        _ => SmallVec::new(),
    };
    if !at.is_empty() {
        strip_pieces(parts, &at);
    }
}

/// Names the consumer upstream in the route's consumer header.
fn set_consumer(snap: &Snapshot, auth: &AuthConfig, consumer: usize, parts: &mut Parts) {
    // Names are checked printable ASCII when loaded.
    if let Ok(v) = HeaderValue::from_str(snap.consumer_name(consumer)) {
        parts.headers.insert(auth.consumer_header.clone(), v);
    }
}

/// Keeps the one key a request may carry: the same key repeated is fine, two are refused.
fn one_key<'a>(found: &mut Option<Cow<'a, str>>, key: Cow<'a, str>) -> Result<(), Refusal> {
    match found {
        Some(k) if *k != key => Err(Refusal::AmbiguousKey),
        Some(_) => Ok(()),
        None => {
            *found = Some(key);
            Ok(())
        }
    }
}

/// The query's parameters as raw `(offset, name, value)`, the offset being where the
/// parameter starts in `query`. `;` separates them as well as `&`, as some backends read it.
fn params(query: &str) -> impl Iterator<Item = (usize, &str, &str)> {
    let base = query.as_ptr() as usize;
    query.split(['&', ';']).map(move |pair| {
        let (name, value) = split_pair(pair);
        (pair.as_ptr() as usize - base, name, value)
    })
}

/// Whether a raw parameter name is one of `names` in any spelling a backend reads
/// ([`crate::query`]): percent-decoded, in any ASCII case, with an array suffix
/// (`apikey[]`), or with PHP's `_` for `.` and spaces (`user.key` is `user_key`).
fn is_credential(raw: &str, names: &[String]) -> bool {
    crate::query::is_one_of(raw, names)
}

/// Removes the parameters starting at `offsets` (as [`params`] gives them) from the
/// request's query. The request goes upstream in origin form: only path and query are kept.
fn strip_pieces(parts: &mut Parts, offsets: &[usize]) {
    let Some(query) = parts.uri.query() else {
        return;
    };
    let path = parts.uri.path();
    let pq = without_pieces(path, query, |at, _| offsets.contains(&at));
    // Made of pieces of a valid URI, so it parses; if it somehow does not, keep the path alone.
    parts.uri = PathAndQuery::try_from(pq)
        .or_else(|_| PathAndQuery::try_from(path.to_string()))
        .map(http::Uri::from)
        .unwrap_or_default();
}

/// `path?query` without the parameters named in `names` (matched as [`authenticate`]
/// matches them); the other pieces keep their separators. The access log's cut, as a
/// string: the tests hold [`kept_pieces`] and stripping to it.
#[cfg(test)]
fn without_credentials(path: &str, query: &str, names: &[String]) -> String {
    without_pieces(path, query, |_, name| is_credential(name, names))
}

pub use crate::query::percent_decode;
use crate::query::{split_pair, without_pieces};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query::kept_pieces;

    #[test]
    fn finds_and_decodes_params() {
        let names = vec!["apikey".to_string(), "user_key".to_string()];
        assert!(is_credential("user_key", &names));
        assert!(is_credential("%61pikey", &names));
        assert!(is_credential("APIKEY", &names));
        assert!(is_credential("apikey[]", &names));
        assert!(is_credential("apikey%5B0%5D", &names));
        assert!(!is_credential("apikeyx", &names));
        let found: Vec<_> = params("a=1;apikey=2&b").collect();
        assert_eq!(found, [(0, "a", "1"), (4, "apikey", "2"), (13, "b", "")]);
        assert_eq!(percent_decode("k%2B1"), "k+1");
        assert_eq!(percent_decode("bad%zz"), "bad%zz");
        assert_eq!(percent_decode("end%4"), "end%4");
    }

    #[test]
    fn stripping_keeps_the_other_pieces_and_their_separators() {
        let names = vec!["apikey".to_string()];
        for (q, want) in [
            ("/p?q=a;b&apikey=t1", "/p?q=a;b"),
            ("/p?apikey=t1;x=1&y=2", "/p?x=1&y=2"),
            ("/p?x=1&%61pikey=t1;y=2", "/p?x=1;y=2"),
            ("/p?apikey=t1", "/p"),
        ] {
            let (parts, _) = http::Request::get(q).body(()).expect("req").into_parts();
            let mut parts = Parts::from(parts);
            let (path, query) = (parts.uri.path(), parts.uri.query().unwrap_or(""));
            assert_eq!(without_credentials(path, query, &names), want, "{q}");
            let mut logged = path.to_string();
            kept_pieces(query, &names, |sep, piece| {
                logged.push(char::from(sep));
                logged.push_str(piece);
            });
            assert_eq!(logged, want, "{q}");
            let at: Vec<usize> = params(query)
                .filter(|(_, name, _)| is_credential(name, &names))
                .map(|(at, _, _)| at)
                .collect();
            strip_pieces(&mut parts, &at);
            assert_eq!(parts.uri.to_string(), want, "{q}");
        }
    }
}
