//! A decoded header block made into a request, or refused as malformed (RFC 9113 §8.1.2,
//! §8.2, §8.3): a stream error, never a guess.

use super::hpack::{Field, Pseudo};
use crate::exchange::{Fields, Parts};
use crate::inbound::{KEEP_ALIVE, PROXY_CONNECTION};
use http::header::{HeaderMap, HeaderName};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Uri, Version};

/// A request's head, and its declared body length.
pub struct Head {
    pub parts: crate::exchange::Parts,
    pub length: Option<u64>,
}

/// Why a request is malformed.
pub type Malformed = &'static str;

/// Builds a request head from `fields`.
pub fn head(fields: Vec<Field>) -> Result<Head, Malformed> {
    let mut method = None;
    let mut scheme = None;
    let mut authority = None;
    let mut path = None;
    let mut headers = Fields::with_capacity(fields.len() + 8);
    let mut regular = false;
    for f in fields {
        match f {
            Field::Pseudo(p, v) => {
                if regular {
                    return Err("pseudo-header field after a regular one");
                }
                let slot = match p {
                    Pseudo::Method => &mut method,
                    Pseudo::Scheme => &mut scheme,
                    Pseudo::Authority => &mut authority,
                    Pseudo::Path => &mut path,
                    Pseudo::Other => return Err("pseudo-header field not allowed in a request"),
                };
                if slot.replace(v).is_some() {
                    return Err("pseudo-header field twice");
                }
            }
            Field::Header(n, v) => {
                regular = true;
                if is_connection_specific(&n) {
                    return Err("connection-specific header field");
                }
                if n == http::header::TE && v.as_bytes() != b"trailers" {
                    return Err("te other than trailers");
                }
                headers.append(n, v);
            }
            Field::Malformed => return Err("invalid field name or value"),
        }
    }
    let method = method.ok_or("no :method")?;
    let method = Method::from_bytes(&method).map_err(|_| "invalid :method")?;
    let authority = match authority {
        Some(a) => Some(Authority::from_maybe_shared(a).map_err(|_| "invalid :authority")?),
        None => None,
    };
    let mut uri = http::uri::Parts::default();
    if method == Method::CONNECT {
        // Extended CONNECT is not offered: a CONNECT names only an authority.
        if scheme.is_some() || path.is_some() {
            return Err("CONNECT with :scheme or :path");
        }
        uri.authority = Some(authority.ok_or("CONNECT without :authority")?);
    } else {
        let scheme = scheme.ok_or("no :scheme")?;
        let path = path.ok_or("no :path")?;
        let asterisk = &path[..] == b"*" && method == Method::OPTIONS;
        if !path.starts_with(b"/") && !asterisk {
            return Err("invalid :path");
        }
        uri.path_and_query =
            Some(PathAndQuery::from_maybe_shared(path).map_err(|_| "invalid :path")?);
        // A URI has a scheme only beside an authority.
        if let Some(a) = authority {
            uri.scheme = Some(Scheme::try_from(&scheme[..]).map_err(|_| "invalid :scheme")?);
            uri.authority = Some(a);
        }
    }
    let uri = Uri::from_parts(uri).map_err(|_| "invalid request target")?;
    let mut length = None;
    let mut lengths = 0;
    for v in headers.get_all(http::header::CONTENT_LENGTH) {
        lengths += 1;
        let n = std::str::from_utf8(v.as_bytes())
            .ok()
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or("invalid content-length")?;
        if length.is_some_and(|l| l != n) {
            return Err("content-length twice, differing");
        }
        length = Some(n);
    }
    // Equal repeats go on as one length, for upstreams that refuse a repeated field.
    if lengths > 1 {
        if let Some(first) = headers.remove(http::header::CONTENT_LENGTH) {
            headers.append(http::header::CONTENT_LENGTH, first);
        }
    }
    let parts = Parts::new(method, uri, Version::HTTP_2, headers);
    Ok(Head { parts, length })
}

/// Trailers: regular fields only (RFC 9113 §8.1).
pub fn trailers(fields: Vec<Field>) -> Result<HeaderMap, Malformed> {
    let mut map = HeaderMap::with_capacity(fields.len());
    for f in fields {
        match f {
            Field::Header(n, v) if !is_connection_specific(&n) => {
                map.append(n, v);
            }
            Field::Pseudo(..) => return Err("pseudo-header field in trailers"),
            _ => return Err("invalid field in trailers"),
        }
    }
    Ok(map)
}

/// The fields HTTP/2 does not carry (RFC 9113 §8.2.2).
pub fn is_connection_specific(n: &HeaderName) -> bool {
    use http::header::{CONNECTION, TRANSFER_ENCODING, UPGRADE};
    *n == CONNECTION
        || *n == TRANSFER_ENCODING
        || *n == UPGRADE
        || *n == KEEP_ALIVE
        || *n == PROXY_CONNECTION
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::HeaderValue;

    fn p(which: Pseudo, v: &'static str) -> Field {
        Field::Pseudo(which, Bytes::from_static(v.as_bytes()))
    }

    fn h(n: &'static str, v: &'static str) -> Field {
        Field::Header(HeaderName::from_static(n), HeaderValue::from_static(v))
    }

    fn get(extra: Vec<Field>) -> Vec<Field> {
        let mut f = vec![
            p(Pseudo::Method, "GET"),
            p(Pseudo::Scheme, "https"),
            p(Pseudo::Authority, "api.test"),
            p(Pseudo::Path, "/a?b=1"),
        ];
        f.extend(extra);
        f
    }

    #[test]
    fn builds_a_request_and_refuses_malformed_ones() {
        let ok = head(get(vec![h("content-length", "3"), h("te", "trailers")])).expect("ok");
        assert_eq!(ok.parts.uri, "https://api.test/a?b=1");
        assert_eq!(ok.parts.version, Version::HTTP_2);
        assert_eq!(ok.length, Some(3));
        let twice = head(get(vec![
            h("content-length", "3"),
            h("content-length", "003"),
        ]))
        .expect("equal lengths");
        assert_eq!(twice.length, Some(3));
        let sent: Vec<_> = twice.parts.headers.get_all("content-length").collect();
        assert_eq!(sent, ["3"], "one length goes on");
        let bad: Vec<(Vec<Field>, &str)> = vec![
            (get(vec![h("connection", "close")]), "connection-specific"),
            (get(vec![h("te", "gzip")]), "te"),
            (
                get(vec![h("x-a", "1"), p(Pseudo::Path, "/")]),
                "pseudo after regular",
            ),
            (get(vec![p(Pseudo::Other, "200")]), ":status in a request"),
            (get(vec![p(Pseudo::Method, "GET")]), ":method twice"),
            (
                get(vec![h("content-length", "1"), h("content-length", "2")]),
                "two lengths",
            ),
            (get(vec![Field::Malformed]), "a malformed field"),
            (
                vec![p(Pseudo::Method, "GET"), p(Pseudo::Scheme, "http")],
                "no :path",
            ),
            (
                vec![
                    p(Pseudo::Method, "GET"),
                    p(Pseudo::Scheme, "http"),
                    p(Pseudo::Path, "a"),
                ],
                "relative :path",
            ),
            (
                vec![
                    p(Pseudo::Method, "CONNECT"),
                    p(Pseudo::Authority, "a:1"),
                    p(Pseudo::Path, "/"),
                ],
                "CONNECT with :path",
            ),
        ];
        for (fields, what) in bad {
            assert!(head(fields).is_err(), "accepted: {what}");
        }
        let connect = head(vec![
            p(Pseudo::Method, "CONNECT"),
            p(Pseudo::Authority, "a:1"),
        ]);
        assert_eq!(connect.expect("CONNECT").parts.uri, "a:1");
        assert!(trailers(vec![p(Pseudo::Path, "/")]).is_err());
    }
}
