//! Bearer tokens (JWT, RFC 7519): the token in `Authorization: Bearer` is verified with the
//! route's keys and only the algorithms it lists, then its `exp`, `nbf`, `iss` and `aud`
//! are checked against the gateway's clock. The consumer claim names the caller: a listed
//! consumer, or (on routes that give one a plan) a guest counted like any consumer. A
//! verified token is remembered until it expires, so a repeat costs one lookup.

use crate::clock::Clock;
use crate::exchange::{Parts, Refusal};
use crate::jwks::{Key, Verified};
use crate::snapshot::{RouteJwt, Snapshot};
use http::header::AUTHORIZATION;
use http::HeaderValue;
use jsonwebtoken::Validation;
use serde_json::{Map, Value};
use smallvec::SmallVec;
use std::sync::Arc;

/// Keys tried for a token that names none (`kid`): a set rarely holds more of one kind.
const MAX_TRIED: usize = 4;

/// Longest consumer name a claim may give.
const MAX_NAME: usize = 256;

/// The request's bearer token (its `Authorization` value shares the request's bytes):
/// `None` when it has no `Authorization: Bearer`, refused when it has more than one
/// `Authorization`.
pub fn bearer(parts: &Parts) -> Result<Option<HeaderValue>, Refusal> {
    Ok(token(parts)?
        .map(|_| ())
        .and_then(|()| parts.headers.get(AUTHORIZATION).cloned()))
}

/// The token in an `Authorization: Bearer` value.
pub fn token_in(v: &HeaderValue) -> &str {
    v.to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        .map_or("", |(_, t)| t.trim_matches(' '))
}

fn token(parts: &Parts) -> Result<Option<&str>, Refusal> {
    let mut all = parts.headers.get_all(AUTHORIZATION).iter();
    let Some(first) = all.next() else {
        return Ok(None);
    };
    if all.next().is_some() {
        return Err(Refusal::AmbiguousToken);
    }
    let Ok(v) = first.to_str() else {
        return Ok(None);
    };
    let Some((scheme, token)) = v.split_once(' ') else {
        // `Bearer ` arrives as `Bearer`: the space after it is not part of the value.
        if v.eq_ignore_ascii_case("bearer") {
            return Err(Refusal::InvalidToken("empty token"));
        }
        return Ok(None);
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Ok(None);
    }
    let token = token.trim_matches(' ');
    if token.is_empty() {
        return Err(Refusal::InvalidToken("empty token"));
    }
    Ok(Some(token))
}

/// Verifies `token` (or finds it verified) and returns its consumer; sets the headers its
/// claims give.
pub fn verify(
    snap: &Snapshot,
    jwt: &RouteJwt,
    token: &str,
    parts: &mut Parts,
    clock: &dyn Clock,
) -> Result<usize, Refusal> {
    if token.len() > jwt.cfg.max_token_bytes {
        return Err(Refusal::InvalidToken("token too large"));
    }
    let now = clock.wall_nanos() / 1_000_000_000;
    let generation = jwt.keys.generation();
    let roster = snap.roster.changes();
    let fresh = |v: &Arc<Verified>| v.generation == generation && v.roster == roster;
    let verified = match jwt.tokens.get(token).filter(fresh) {
        Some(v) => v,
        None => {
            let v = Arc::new(check(snap, jwt, token, (generation, roster), now)?);
            jwt.tokens.put(token, v.clone());
            v
        }
    };
    in_time(
        verified.exp,
        verified.nbf,
        now,
        jwt.cfg.clock_skew.as_secs(),
    )?;
    for (name, value) in &verified.headers {
        parts.headers.insert(name.clone(), value.clone());
    }
    Ok(verified.consumer)
}

/// `exp` and `nbf` against `now`, with the route's tolerance.
fn in_time(exp: Option<u64>, nbf: Option<u64>, now: u64, skew: u64) -> Result<(), Refusal> {
    if exp.is_some_and(|exp| now >= exp.saturating_add(skew)) {
        return Err(Refusal::InvalidToken("token expired"));
    }
    if nbf.is_some_and(|nbf| now.saturating_add(skew) < nbf) {
        return Err(Refusal::InvalidToken("token not yet valid"));
    }
    Ok(())
}

/// Why a token's header could not be read: an algorithm the library does not know (`none`
/// among them) is named as such; a header wrong elsewhere is malformed.
fn unreadable_header(token: &str) -> Refusal {
    use base64::Engine;
    let unknown_alg = token
        .split('.')
        .next()
        .and_then(|h| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(h)
                .ok()
        })
        .and_then(|h| serde_json::from_slice::<Map<String, Value>>(&h).ok())
        .and_then(|h| h.get("alg").and_then(Value::as_str).map(str::to_string))
        // A name the library knows means the header is wrong elsewhere.
        .is_some_and(|alg| alg.parse::<jsonwebtoken::Algorithm>().is_err());
    Refusal::InvalidToken(if unknown_alg {
        "signing algorithm not accepted"
    } else {
        "malformed token"
    })
}

/// The full check of a token not seen before.
fn check(
    snap: &Snapshot,
    jwt: &RouteJwt,
    token: &str,
    (generation, roster): (u64, u64),
    now: u64,
) -> Result<Verified, Refusal> {
    let header = jsonwebtoken::decode_header(token).map_err(|_| unreadable_header(token))?;
    // RFC 7515 §4.1.11: extensions the recipient must understand; none are understood here.
    if header.crit.is_some() {
        return Err(Refusal::InvalidToken("critical header not supported"));
    }
    let alg = header.alg;
    if !jwt.algorithms.contains(&alg) {
        return Err(Refusal::InvalidToken("signing algorithm not accepted"));
    }
    let keys = jwt.keys.keys();
    if keys.list.is_empty() {
        // Never fetched yet (the issuer was down): try again, within the refetch bound,
        // and wait for that try when it starts at once.
        let why = "signing keys unavailable";
        return Err(match jwt.keys.missed_with_wait() {
            Some(seen) => Refusal::KeysComing { seen, why },
            None => Refusal::InvalidToken(why),
        });
    }
    // A secret verifies whatever `kid` the token names; a key set's key is found by id.
    let by_id = header.kid.as_deref().filter(|_| !keys.secret);
    let fits = |k: &&Key| {
        by_id.is_none_or(|id| k.kid.as_deref() == Some(id))
            && k.alg.is_none_or(|a| a == alg)
            && k.key.family() == alg.family()
    };
    let candidates: SmallVec<[&Key; MAX_TRIED]> =
        keys.list.iter().filter(fits).take(MAX_TRIED).collect();
    if candidates.is_empty() {
        if by_id.is_some() && !keys.list.iter().any(|k| k.kid.as_deref() == by_id) {
            // An issuer's rotation: the request waits for the fetch the miss starts (or
            // the one under way) and is checked again, as Kong's and Envoy's do.
            let why = "unknown key id";
            return Err(match jwt.keys.missed_with_wait() {
                Some(seen) => Refusal::KeysComing { seen, why },
                None => Refusal::InvalidToken(why),
            });
        }
        return Err(Refusal::InvalidToken("no key for this algorithm"));
    }
    let mut validation = Validation::new(alg);
    // Time and audience are checked below, against the gateway's clock and with strict
    // types; the library checks the signature and the algorithm only.
    validation.required_spec_claims.clear();
    validation.validate_exp = false;
    validation.validate_nbf = false;
    validation.validate_aud = false;
    validation.leeway = 0;
    let mut error = "bad signature";
    let mut claims = None;
    for key in candidates {
        match jsonwebtoken::decode::<Map<String, Value>>(token, &key.key, &validation) {
            Ok(data) => {
                claims = Some(data.claims);
                break;
            }
            Err(e) => error = describe(&e),
        }
    }
    let claims = claims.ok_or(Refusal::InvalidToken(error))?;

    let exp = time_claim(&claims, "exp")?.ok_or(Refusal::InvalidToken("token has no exp"))?;
    let nbf = time_claim(&claims, "nbf")?;
    in_time(Some(exp), nbf, now, jwt.cfg.clock_skew.as_secs())?;
    if let Some(issuer) = &jwt.cfg.issuer {
        if claims.get("iss").and_then(Value::as_str) != Some(issuer.as_str()) {
            return Err(Refusal::InvalidToken("wrong issuer"));
        }
    }
    if !jwt.cfg.audiences.is_empty() {
        let wanted = |a: &Value| {
            a.as_str()
                .is_some_and(|a| jwt.cfg.audiences.iter().any(|w| w == a))
        };
        let ok = match claims.get("aud") {
            Some(Value::Array(list)) => list.iter().any(wanted),
            Some(one) => wanted(one),
            None => false,
        };
        if !ok {
            return Err(Refusal::InvalidToken("wrong audience"));
        }
    }
    let consumer = consumer(snap, jwt, &claims)?;
    let mut headers = SmallVec::new();
    for (name, claim) in &jwt.cfg.claims_to_headers {
        let text = match claims.get(claim) {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
        };
        // A claim that is not header text is left out rather than sent mangled.
        if let Ok(v) = HeaderValue::from_str(&text) {
            headers.push((name.clone(), v));
        }
    }
    Ok(Verified {
        consumer,
        exp: Some(exp),
        nbf,
        generation,
        roster,
        headers,
    })
}

/// A NumericDate claim: absent, or a number of seconds (a fraction is dropped). Anything
/// else makes the token invalid rather than the claim absent.
fn time_claim(claims: &Map<String, Value>, name: &str) -> Result<Option<u64>, Refusal> {
    match claims.get(name) {
        None => Ok(None),
        Some(v) => match (v.as_u64(), v.as_f64()) {
            (Some(n), _) => Ok(Some(n)),
            (None, Some(f)) if f >= 0.0 && f.is_finite() => Ok(Some(f as u64)),
            (None, Some(_)) => Err(Refusal::InvalidToken(if name == "exp" {
                "exp is before 1970"
            } else {
                "nbf is before 1970"
            })),
            _ => Err(Refusal::InvalidToken(if name == "exp" {
                "exp is not a number"
            } else {
                "nbf is not a number"
            })),
        },
    }
}

/// Who the claims name: a listed consumer, or a guest on the plan the token or the route
/// gives a caller the gateway does not list.
fn consumer(
    snap: &Snapshot,
    jwt: &RouteJwt,
    claims: &Map<String, Value>,
) -> Result<usize, Refusal> {
    // A whole number (a numeric user id) names the caller as its digits do.
    let digits;
    let name = match claims.get(&jwt.cfg.consumer_claim) {
        Some(Value::String(s)) if !s.is_empty() => s.as_str(),
        Some(Value::Number(n)) if n.is_u64() || n.is_i64() => {
            digits = n.to_string();
            digits.as_str()
        }
        None | Some(Value::Null) => return Err(Refusal::InvalidToken("no consumer claim")),
        Some(Value::String(_)) => return Err(Refusal::InvalidToken("no consumer claim")),
        Some(_) => return Err(Refusal::InvalidToken("consumer claim is not a usable name")),
    };
    // It is sent upstream in a header and logged: visible ASCII, no quote or backslash.
    let usable = name != tollgate_config::NO_CONSUMER
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| (0x21..0x7f).contains(&b) && b != b'"' && b != b'\\');
    if !usable {
        return Err(Refusal::InvalidToken("consumer claim is not a usable name"));
    }
    if snap.roster.get(name).is_some_and(|m| m.deleted) {
        return Err(Refusal::InvalidToken("consumer deleted"));
    }
    if let Some(i) = snap.find_consumer(name)? {
        return Ok(i);
    }
    // A caller the gateway does not list is named by the issuer, perhaps as its user
    // chose: a `,` or `;` would let a backend reading `X-Consumer` as a list (or its
    // parameters) see another name in it.
    if name.bytes().any(|b| b == b',' || b == b';') {
        return Err(Refusal::InvalidToken("consumer claim is not a usable name"));
    }
    let from_claim = jwt
        .cfg
        .plan_claim
        .as_ref()
        .and_then(|c| claims.get(c))
        .and_then(Value::as_str)
        .and_then(|p| snap.config.plans.iter().position(|plan| plan.name == p));
    let plan = from_claim
        .or(jwt.cfg.anonymous_plan)
        .ok_or(Refusal::InvalidToken("unknown consumer"))?;
    snap.counters
        .guest(name, plan)
        .ok_or(Refusal::TooManyGuests)
}

/// A verification failure as `error_description` words.
fn describe(e: &jsonwebtoken::errors::Error) -> &'static str {
    use jsonwebtoken::errors::ErrorKind;
    match e.kind() {
        ErrorKind::InvalidSignature => "bad signature",
        ErrorKind::InvalidAlgorithm | ErrorKind::InvalidAlgorithmName => {
            "algorithm does not match the key"
        }
        ErrorKind::Json(_)
        | ErrorKind::Base64(_)
        | ErrorKind::Utf8(_)
        | ErrorKind::InvalidToken => "malformed token",
        _ => "bad signature",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_checks_allow_the_skew_and_no_more() {
        assert!(in_time(Some(100), None, 99, 0).is_ok());
        assert!(in_time(Some(100), None, 100, 0).is_err());
        assert!(in_time(Some(100), None, 129, 30).is_ok());
        assert!(in_time(Some(100), None, 130, 30).is_err());
        assert!(in_time(None, Some(200), 170, 30).is_ok());
        assert!(in_time(None, Some(200), 169, 30).is_err());
    }

    #[test]
    fn time_claims_must_be_numbers() {
        let claims: Map<String, Value> =
            serde_json::from_str(r#"{"exp":"9999999999","nbf":1.5}"#).expect("json");
        assert!(time_claim(&claims, "exp").is_err());
        assert_eq!(time_claim(&claims, "nbf").ok().flatten(), Some(1));
        assert_eq!(time_claim(&claims, "iat").ok().flatten(), None);
    }

    #[test]
    fn bearer_takes_one_authorization_only() {
        let req = |values: &[&str]| {
            let mut b = http::Request::get("/");
            for v in values {
                b = b.header(AUTHORIZATION, *v);
            }
            Parts::from(b.body(()).expect("request").into_parts().0)
        };
        let got = |v: &[&str]| {
            bearer(&req(v))
                .ok()
                .flatten()
                .map(|v| token_in(&v).to_string())
        };
        assert_eq!(got(&["Bearer abc"]).as_deref(), Some("abc"));
        assert_eq!(got(&["bearer  abc "]).as_deref(), Some("abc"));
        assert_eq!(got(&["Basic abc"]), None);
        assert_eq!(got(&[]), None);
        assert!(matches!(
            bearer(&req(&["Bearer a", "Bearer b"])),
            Err(Refusal::AmbiguousToken)
        ));
        for empty in ["Bearer ", "bearer", "BEARER   "] {
            assert!(matches!(
                bearer(&req(&[empty])),
                Err(Refusal::InvalidToken("empty token"))
            ));
        }
    }
}
