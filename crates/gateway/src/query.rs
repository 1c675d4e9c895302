//! Query parameters as backends read them: one place that says when two raw names are the
//! same parameter, for credentials (every spelling is a credential) and the cache's keyed
//! parameters (every spelling is keyed).
//!
//! Backends read names loosely: percent-decoded, `+` as a space, in any ASCII case (ASP.NET),
//! with an array suffix (`name[]`, `name[0]` in PHP and Rack), and PHP rewrites leading
//! spaces away and `.`, ` ` and an unclosed `[` to `_` (`user.key` is `user_key`). A name
//! is held to all of these at once, so no spelling passes as another parameter.

use std::borrow::Cow;

/// `name=value` as `(name, value)`; a piece without `=` is a name with an empty value.
/// A byte loop: pieces are short, and `split_once`'s searcher costs more than it saves.
pub fn split_pair(pair: &str) -> (&str, &str) {
    match pair.bytes().position(|b| b == b'=') {
        Some(i) => (&pair[..i], &pair[i + 1..]),
        None => (pair, ""),
    }
}

/// Decodes `%XX` escapes and `+` (as space); invalid escapes are kept as written.
pub fn percent_decode(s: &str) -> Cow<'_, str> {
    if !s.bytes().any(|b| b == b'%' || b == b'+') {
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

/// A raw parameter name as a backend reads it, before case and `_` folding: decoded,
/// leading spaces dropped, an array suffix (`[...]` closed later in the name) cut off.
pub fn param_name(raw: &str) -> Cow<'_, str> {
    // Most names hold no escape, suffix or leading space: taken as they are.
    let b = raw.as_bytes();
    if !b.iter().any(|&c| matches!(c, b'%' | b'+' | b'[' | 0)) && !raw.starts_with(' ') {
        return Cow::Borrowed(raw);
    }
    let decoded = percent_decode(raw);
    // PHP reads a name up to a NUL, escaped (`page%00x` is `page`) or not.
    let decoded = decoded.split('\0').next().unwrap_or("");
    let trimmed = decoded.trim_start_matches(' ');
    let name = match trimmed.find('[') {
        Some(i) if trimmed[i..].contains(']') => &trimmed[..i],
        _ => trimmed,
    };
    Cow::Owned(name.to_string())
}

/// One byte of a name, folded: ASCII lower case, and PHP's `_` for `.`, ` ` and `[`.
fn fold(c: u8) -> u8 {
    match c {
        b'.' | b' ' | b'[' => b'_',
        c => c.to_ascii_lowercase(),
    }
}

/// Whether `name` (from [`param_name`]) and `configured` are the same parameter.
pub fn same_param(name: &str, configured: &str) -> bool {
    name.len() == configured.len()
        && name
            .bytes()
            .zip(configured.bytes())
            .all(|(a, b)| fold(a) == fold(b))
}

/// Whether the raw parameter name `raw` is one of `names` in any spelling a backend reads.
pub fn is_one_of(raw: &str, names: &[String]) -> bool {
    let name = param_name(raw);
    names.iter().any(|n| same_param(&name, n))
}

/// Hands each piece of `query` that is not a credential named in `names` to `keep`, with
/// the separator that goes before it (`?` for the first kept one): the access log writes
/// the logged target this way, without building it first.
pub fn kept_pieces<'q>(query: &'q str, names: &[String], keep: impl FnMut(u8, &'q str)) {
    for_kept(query, |_, name| is_one_of(name, names), keep);
}

/// `path?query` without the pieces `drop(offset in query, raw name)` picks; the other
/// pieces keep their separators.
pub fn without_pieces(path: &str, query: &str, drop: impl Fn(usize, &str) -> bool) -> String {
    let mut pq = String::with_capacity(path.len() + 1 + query.len());
    pq.push_str(path);
    for_kept(query, drop, |sep, pair| {
        pq.push(char::from(sep));
        pq.push_str(pair);
    });
    pq
}

/// Calls `keep(separator, piece)` for each piece of `query` that `drop(offset in query,
/// raw name)` does not pick; the first kept piece gets `?`, the others keep theirs.
fn for_kept<'q>(
    query: &'q str,
    drop: impl Fn(usize, &str) -> bool,
    mut keep: impl FnMut(u8, &'q str),
) {
    let mut first = true;
    let mut sep = b'&';
    let mut rest = query;
    loop {
        let end = rest
            .bytes()
            .position(|b| b == b'&' || b == b';')
            .unwrap_or(rest.len());
        let pair = &rest[..end];
        if !drop(query.len() - rest.len(), split_pair(pair).0) {
            keep(if first { b'?' } else { sep }, pair);
            first = false;
        }
        if end == rest.len() {
            break;
        }
        sep = rest.as_bytes()[end];
        rest = &rest[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_a_backend_reads_is_the_same_name() {
        let names = vec!["apikey".to_string(), "user_key".to_string()];
        for same in [
            "apikey",
            "APIKEY",
            "%61pikey",
            "apikey[]",
            "apikey%5B0%5D",
            "user_key",
            "user.key",
            "user key",
            "user+key",
            "user[key",
            "%20user_key",
            "+user_key",
            "User.Key",
            "apikey%00x",
        ] {
            assert!(is_one_of(same, &names), "{same}");
        }
        for other in ["apikeyx", "api_key", "user_keys", "userkey", "user[key]"] {
            assert!(!is_one_of(other, &names), "{other}");
        }
    }

    #[test]
    fn escapes_decode_as_backends_decode_them() {
        assert_eq!(percent_decode("k%2B1"), "k+1");
        assert_eq!(percent_decode("bad%zz"), "bad%zz");
        assert_eq!(percent_decode("end%4"), "end%4");
    }
}
