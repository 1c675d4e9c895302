//! `auth.jwt:`: where the signing keys come from, which algorithms and claims a token needs,
//! and what in it names the caller. Key files are read here, so a bad one is reported with
//! its place like any other problem.

use super::problems::Problems;
use crate::file;
use crate::token::{JwtAlgorithm, JwtConfig, JwtKeys};
use http::HeaderName;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// RFC 7518 §3.2: an HMAC key at least as long as the hash output (HS256: 32 bytes).
const MIN_SECRET: usize = 32;

/// Headers a claim never sets: they frame or route the request, carry credentials, or are
/// the gateway's own (the client's address and protocol, the request id).
const RESERVED: &[&str] = &[
    "authorization",
    "connection",
    "content-length",
    "cookie",
    "forwarded",
    "host",
    "keep-alive",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "x-api-key",
    "x-consumer",
    "x-real-ip",
    "x-request-id",
];

/// Validates `auth.jwt` at `at` (`routes[i].auth.jwt`); files are read from `base`.
pub(super) fn jwt(
    j: &file::Jwt,
    at: &str,
    base: &Path,
    plan_index: &HashMap<String, usize>,
    p: &mut Problems,
) -> Option<JwtConfig> {
    let sources = [
        j.jwks_url.is_some(),
        j.jwks_file.is_some(),
        j.secret_file.is_some(),
    ];
    // A source that cannot be used stops nothing else from being checked: every problem
    // of the route's `jwt` is reported at once.
    let given = sources.iter().filter(|s| **s).count();
    let user_info = |u: &str| {
        url::Url::parse(u).is_ok_and(|u| !u.username().is_empty() || u.password().is_some())
    };
    if j.issuer.as_deref().is_some_and(user_info) {
        p.add(
            format!("{at}.issuer"),
            "the issuer is what tokens' `iss` says, without user info; credentials for fetching the keys go in `jwks_url`",
        );
    }
    if let Some(u) = j
        .jwks_url
        .as_deref()
        .filter(|u| user_info(u) && u.starts_with("http://"))
    {
        p.warn(
            format!("{at}.jwks_url"),
            format!(
                "{:?} sends its credentials in the clear (http://); use https://",
                crate::redacted_url(u)
            ),
        );
    }
    // The key file read, with what it held: an edit reloads the config (a rotated secret).
    let mut key_file = None;
    let keys = match given {
        0 => match &j.issuer {
            Some(issuer) => {
                url(issuer, &format!("{at}.issuer"), "discovery", p);
                Some(JwtKeys::Discovery(issuer.clone()))
            }
            None => {
                p.add(
                    at,
                    "needs `issuer` (its OpenID metadata names the keys), `jwks_url`, `jwks_file` or `secret_file`",
                );
                None
            }
        },
        1 => {
            if let Some(u) = &j.jwks_url {
                url(u, &format!("{at}.jwks_url"), "jwks", p);
                Some(JwtKeys::Url(u.clone()))
            } else if let Some(f) = &j.jwks_file {
                let (keys, read) = jwks_file(f, &format!("{at}.jwks_file"), base, p);
                key_file = read;
                keys.map(JwtKeys::File)
            } else {
                let f = j.secret_file.as_deref().unwrap_or_default();
                let (keys, read) = secret_file(f, &format!("{at}.secret_file"), base, p);
                key_file = read;
                keys.map(JwtKeys::Secret)
            }
        }
        _ => {
            p.add(
                at,
                "give one of `jwks_url`, `jwks_file` and `secret_file`, not several",
            );
            None
        }
    };
    // Whether the keys are a shared secret, when the source is clear (one given, or the
    // issuer alone), even if it could not be read.
    let symmetric = match given {
        0 if j.issuer.is_some() => Some(false),
        1 => Some(j.secret_file.is_some()),
        _ => None,
    };
    let mut algorithms = algorithms(j.algorithms.as_deref(), symmetric, at, p);
    if let Some(JwtKeys::Secret(s)) = &keys {
        // RFC 7518 §3.2: a secret at least as long as the hash. Listed algorithms the secret
        // is too short for are refused; left to the default, they are left out.
        match &j.algorithms {
            Some(raw) => {
                for (i, name) in raw.iter().enumerate() {
                    let fits = JwtAlgorithm::ALL.iter().find(|(n, _)| n == name);
                    if let Some(&(_, a)) = fits.filter(|(_, a)| s.len() < a.min_secret()) {
                        p.add(
                            format!("{at}.algorithms[{i}]"),
                            format!(
                                "{name} needs a secret of at least {} bytes (RFC 7518 §3.2); the secret has {}",
                                a.min_secret(),
                                s.len()
                            ),
                        );
                    }
                }
            }
            None => {
                let dropped: Vec<&str> = JwtAlgorithm::ALL
                    .iter()
                    .filter(|(_, a)| algorithms.contains(a) && s.len() < a.min_secret())
                    .map(|(n, _)| *n)
                    .collect();
                if !dropped.is_empty() {
                    p.warn(
                        format!("{at}.secret_file"),
                        format!(
                            "the secret has {} bytes, too short for {} (RFC 7518 §3.2): tokens signed so are refused",
                            s.len(),
                            dropped.join(", ")
                        ),
                    );
                }
                algorithms.retain(|a| s.len() >= a.min_secret());
            }
        }
    }

    let consumer_claim = j.consumer_claim.clone().unwrap_or_else(|| "sub".into());
    if consumer_claim.is_empty() {
        p.add(format!("{at}.consumer_claim"), "must name a claim");
    }
    if j.plan_claim.as_deref() == Some("") {
        p.add(format!("{at}.plan_claim"), "must name a claim");
    }
    let anonymous_plan = j.anonymous_plan.as_ref().and_then(|name| {
        let found = plan_index.get(name).copied();
        if found.is_none() {
            p.add(
                format!("{at}.anonymous_plan"),
                format!("unknown plan {name:?}"),
            );
        }
        found
    });
    for (i, a) in j.audiences.iter().enumerate() {
        if a.is_empty() {
            p.add(format!("{at}.audiences[{i}]"), "must not be empty");
        }
    }
    if j.issuer.as_deref() == Some("") {
        p.add(format!("{at}.issuer"), "must not be empty");
    }
    let clock_skew = j.clock_skew.map_or(Duration::from_secs(30), |d| d.0);
    if clock_skew > Duration::from_secs(600) {
        p.add(format!("{at}.clock_skew"), "must be at most 10m");
    }
    let max_token_bytes = j.max_token_bytes.map_or(8192, |s| s.0 as usize);
    if !(256..=65536).contains(&max_token_bytes) {
        p.add(
            format!("{at}.max_token_bytes"),
            "must be between 256 and 64KiB",
        );
    }
    let fetch_timeout = j.fetch_timeout.map_or(Duration::from_secs(10), |d| d.0);
    if fetch_timeout < Duration::from_millis(1) || fetch_timeout > Duration::from_secs(60) {
        p.add(format!("{at}.fetch_timeout"), "must be between 1ms and 60s");
    }
    let mut claims_to_headers = Vec::with_capacity(j.claims_to_headers.len());
    for (header, claim) in &j.claims_to_headers {
        let here = format!("{at}.claims_to_headers.{header}");
        let lower = header.to_ascii_lowercase();
        match HeaderName::from_bytes(lower.as_bytes()) {
            Err(_) => p.add(here, "is not a header name"),
            // Backends read `X_User` and `X-User` as one (CGI, PHP) or drop `_` names
            // (nginx): a client's `X-User` would pass for the claim's `X_User`.
            Ok(_) if lower.contains('_') => p.add(here, "use `-`, not `_`, in the name"),
            Ok(_) if RESERVED.contains(&lower.as_str()) || lower.starts_with("x-forwarded-") => {
                p.add(
                    here,
                    "frames or routes the request, carries credentials or is the gateway's own; a claim may not set it",
                )
            }
            Ok(_) if claim.is_empty() => p.add(here, "must name a claim"),
            Ok(name) => claims_to_headers.push((name, claim.clone())),
        }
    }
    Some(JwtConfig {
        keys: keys?,
        issuer: j.issuer.clone().filter(|i| !i.is_empty()),
        audiences: j.audiences.clone(),
        algorithms,
        consumer_claim,
        plan_claim: j.plan_claim.clone().filter(|c| !c.is_empty()),
        anonymous_plan,
        clock_skew,
        forward_token: j.forward_token,
        claims_to_headers,
        max_token_bytes,
        fetch_timeout,
        key_file,
    })
}

/// An `http://` or `https://` URL with a host.
fn url(raw: &str, at: &str, what: &str, p: &mut Problems) {
    let ok = raw
        .parse::<http::Uri>()
        .is_ok_and(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some());
    if !ok {
        let why = if what == "discovery" {
            "must be an http:// or https:// URL: without `jwks_url`, `jwks_file` or `secret_file` the keys are found through the issuer's OpenID metadata"
        } else {
            "must be an http:// or https:// URL"
        };
        p.add(at, format!("{:?} {why}", crate::redacted_url(raw)));
    }
}

/// The algorithms a route accepts: those listed, or by default every one its keys can
/// verify. HMAC needs a secret and key pairs need a key set, never the other way round (a
/// public key used as an HMAC secret is the classic forgery).
fn algorithms(
    raw: Option<&[String]>,
    symmetric: Option<bool>,
    at: &str,
    p: &mut Problems,
) -> Vec<JwtAlgorithm> {
    let Some(raw) = raw else {
        return JwtAlgorithm::ALL
            .iter()
            .map(|(_, a)| *a)
            .filter(|a| symmetric.is_none_or(|s| a.symmetric() == s))
            .collect();
    };
    if raw.is_empty() {
        p.add(
            format!("{at}.algorithms"),
            "must list at least one algorithm",
        );
    }
    let mut out = Vec::with_capacity(raw.len());
    for (i, name) in raw.iter().enumerate() {
        let here = format!("{at}.algorithms[{i}]");
        if name.eq_ignore_ascii_case("none") {
            p.add(here, "`none` is never accepted: a token must be signed");
            continue;
        }
        let Some(&(_, alg)) = JwtAlgorithm::ALL.iter().find(|(n, _)| n == name) else {
            let known: Vec<&str> = JwtAlgorithm::ALL.iter().map(|(n, _)| *n).collect();
            p.add(
                here,
                format!("unknown algorithm {name:?}; one of {}", known.join(", ")),
            );
            continue;
        };
        if alg.symmetric() && symmetric == Some(false) {
            p.add(
                here,
                format!("{name} is signed with a shared secret: it needs `secret_file`"),
            );
        } else if !alg.symmetric() && symmetric == Some(true) {
            p.add(
                here,
                format!(
                    "{name} is signed with a key pair: it needs `jwks_url`, `jwks_file` or `issuer`"
                ),
            );
        } else if !out.contains(&alg) {
            out.push(alg);
        }
    }
    out
}

/// Reads a JWKS file and checks it holds a `keys` list.
/// A file read, and the fingerprint of what it held.
type Read = Option<(std::path::PathBuf, u64)>;

fn jwks_file(name: &str, at: &str, base: &Path, p: &mut Problems) -> (Option<Arc<str>>, Read) {
    // Beside a config read from the working folder, said as the config names it (not
    // `././keys.json`).
    let path = if base == Path::new(".") {
        Path::new(name).to_path_buf()
    } else {
        base.join(name)
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            p.add(at, format!("cannot read {}: {e}", path.display()));
            return (None, None);
        }
    };
    let read = Some((path.clone(), crate::fingerprint(text.as_bytes())));
    (jwks_text(text, &path, at, p), read)
}

fn jwks_text(text: String, path: &Path, at: &str, p: &mut Problems) -> Option<Arc<str>> {
    let public_keys = |v: &serde_json::Value| {
        v.get("keys")
            .and_then(|k| k.as_array())
            .is_some_and(|keys| {
                keys.iter()
                    .any(|k| k.get("kty").is_some_and(|t| t != "oct"))
            })
    };
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(v) if public_keys(&v) => Some(text.into()),
        Ok(v) if v.get("keys").is_some_and(|k| k.is_array()) => {
            p.add(
                at,
                format!(
                    "{} holds no public key (only shared-secret `oct` keys, or none)",
                    path.display()
                ),
            );
            None
        }
        Ok(_) => {
            p.add(
                at,
                format!(
                    "{} is not a JSON Web Key Set: no `keys` list",
                    path.display()
                ),
            );
            None
        }
        Err(e) => {
            // Its place in the key file as `file:line:column`: the config's own place is
            // added after it.
            let why = e.to_string();
            let why = why.split(" at line ").next().unwrap_or(&why);
            p.add(
                at,
                format!(
                    "{}:{}:{} is not JSON: {why}",
                    path.display(),
                    e.line(),
                    e.column()
                ),
            );
            None
        }
    }
}

/// Reads an HMAC secret (a trailing newline is not part of it).
fn secret_file(name: &str, at: &str, base: &Path, p: &mut Problems) -> (Option<Arc<[u8]>>, Read) {
    let path = base.join(name);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) => {
            p.add(at, format!("cannot read {}: {e}", path.display()));
            return (None, None);
        }
    };
    let read = Some((path.clone(), crate::fingerprint(&bytes)));
    (secret_bytes(bytes, &path, at, p), read)
}

fn secret_bytes(mut bytes: Vec<u8>, path: &Path, at: &str, p: &mut Problems) -> Option<Arc<[u8]>> {
    while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        bytes.pop();
    }
    if bytes.len() < MIN_SECRET {
        p.add(
            at,
            format!(
                "the secret in {} has {} bytes; HMAC needs at least {MIN_SECRET} (RFC 7518 §3.2)",
                path.display(),
                bytes.len()
            ),
        );
        return None;
    }
    Some(bytes.into())
}
