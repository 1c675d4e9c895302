//! API key authentication: the key comes from a header or a query parameter (names set per
//! route), identifies a consumer, and is removed before forwarding unless the route keeps
//! it. The consumer's name goes upstream in a header that clients cannot forge.

use crate::response::Refusal;
use crate::snapshot::{Route, Snapshot};
use http::request::Parts;
use http::uri::PathAndQuery;
use std::borrow::Cow;

/// Identifies the consumer (401 when the key is missing or unknown), removes the
/// credential, and sets the consumer header. Routes without `auth` pass with no consumer.
pub fn authenticate(
    snap: &Snapshot,
    route: &Route,
    parts: &mut Parts,
) -> Result<Option<usize>, Refusal> {
    let Some(auth) = route.cfg.auth.as_ref() else {
        return Ok(None);
    };
    let mut consumer = None;
    let mut in_query = false;
    for name in &auth.header {
        if let Some(v) = parts.headers.get(name) {
            let key = v.to_str().map_err(|_| Refusal::UnknownKey)?;
            consumer = Some(*snap.keys.get(key).ok_or(Refusal::UnknownKey)?);
            break;
        }
    }
    if consumer.is_none() && !auth.query.is_empty() {
        if let Some(raw) = parts.uri.query().and_then(|q| find_param(q, &auth.query)) {
            let key = percent_decode(raw);
            consumer = Some(*snap.keys.get(key.as_ref()).ok_or(Refusal::UnknownKey)?);
            in_query = true;
        }
    }
    let consumer = consumer.ok_or(Refusal::MissingKey)?;

    if !auth.keep_credential {
        for name in &auth.header {
            parts.headers.remove(name);
        }
        if in_query {
            strip_params(parts, &auth.query);
        }
    }
    // Whatever the client sent under the consumer header is replaced, never trusted.
    parts.headers.insert(
        auth.consumer_header.clone(),
        snap.consumers[consumer].header_value.clone(),
    );
    Ok(Some(consumer))
}

/// The raw value of the first query parameter named in `names`.
fn find_param<'q>(query: &'q str, names: &[String]) -> Option<&'q str> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        names.iter().any(|n| n == k).then_some(v)
    })
}

/// Removes every parameter named in `names` from the request's query. The request goes
/// upstream in origin form, so only the path and query are kept.
fn strip_params(parts: &mut Parts, names: &[String]) {
    let Some(query) = parts.uri.query() else {
        return;
    };
    let path = parts.uri.path();
    let mut pq = String::with_capacity(path.len() + 1 + query.len());
    pq.push_str(path);
    let mut sep = '?';
    for pair in query.split('&') {
        let k = pair.split_once('=').map_or(pair, |(k, _)| k);
        if !names.iter().any(|n| n == k) {
            pq.push(sep);
            pq.push_str(pair);
            sep = '&';
        }
    }
    // Made of pieces of a valid URI, so it parses; if it somehow does not, keep the path alone.
    let fallback = path.to_string();
    parts.uri = PathAndQuery::try_from(pq)
        .or_else(|_| PathAndQuery::try_from(fallback))
        .map(http::Uri::from)
        .unwrap_or_default();
}

/// Decodes `%XX` escapes and `+` (as space); invalid escapes are kept as written.
fn percent_decode(s: &str) -> Cow<'_, str> {
    if !s.contains(['%', '+']) {
        return Cow::Borrowed(s);
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_and_decodes_params() {
        let names = vec!["apikey".to_string(), "user_key".to_string()];
        assert_eq!(find_param("a=1&user_key=k%2B1", &names), Some("k%2B1"));
        assert_eq!(percent_decode("k%2B1"), "k+1");
        assert_eq!(percent_decode("bad%zz"), "bad%zz");
        assert_eq!(percent_decode("end%4"), "end%4");
        assert_eq!(find_param("apikeyx=1", &names), None);
    }
}
