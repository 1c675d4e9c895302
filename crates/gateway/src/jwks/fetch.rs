//! Fetching a key set over HTTP(S): through the issuer's OpenID metadata or straight from
//! its URL, on the schedule its `Cache-Control` gives, and again on an unknown key id.

use super::keys::{keys_of, KeySet, Keys, MIN_REFETCH};
use bytes::Bytes;
use http::{header, HeaderValue, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};
use tokio::sync::Notify;
use tokio::time::Instant;
use tollgate_config::redacted_url;

/// Largest metadata document or key set read.
const MAX_BODY: usize = 1 << 20;
/// Refresh period of a set served without `max-age`.
const DEFAULT_FRESH: Duration = Duration::from_secs(300);
/// Longest a set is kept without a fetch.
const MAX_FRESH: Duration = Duration::from_secs(86_400);
/// First wait after a failed fetch; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = MIN_REFETCH;
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// Longest wait between two tries while a set has no key at all.
const NO_KEYS_BACKOFF: Duration = Duration::from_secs(30);

type HttpClient = Client<HttpsConnector<HttpConnector>, Empty<Bytes>>;

fn client() -> Result<HttpClient, String> {
    crate::https_link::client(HttpConnector::new()).map_err(|e| format!("TLS roots: {e}"))
}

/// Fetches the set behind `url` (the issuer's, when `discover`) until no snapshot uses it.
pub(super) async fn run(set: Weak<KeySet>, wake: Arc<Notify>, url: String, discover: bool) {
    // What the log says: the URL without its credentials.
    let shown = tollgate_config::redacted_url(&url);
    let client = match client() {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::error!(source = %shown, "cannot fetch keys: {e}");
            None
        }
    };
    let mut backoff = FIRST_BACKOFF;
    loop {
        let Some(s) = set.upgrade() else { return };
        let timeout = s.timeout();
        let started = Instant::now();
        s.health.lock().last_try = Some(started);
        s.fetch_begins();
        let got = match &client {
            Some(c) => tokio::time::timeout(timeout, fetch(c, &url, discover))
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}"))),
            None => Err("no HTTP client".to_string()),
        };
        let wait = match got {
            Ok((keys, fresh)) => {
                backoff = FIRST_BACKOFF;
                let n = keys.list.len();
                // The keys first, then the count: a fetch counted has its keys in place.
                if !same(&s.keys(), &keys) {
                    s.store(keys);
                }
                let mut h = s.health.lock();
                h.fetched += 1;
                h.last_ok = Some(SystemTime::now());
                if h.failing.take().is_some() {
                    tracing::info!(source = %shown, keys = n, "keys fetched again");
                }
                fresh
            }
            Err(e) => {
                let mut h = s.health.lock();
                h.failed += 1;
                let have = s.keys().list.len();
                if h.failing.as_deref() != Some(e.as_str()) {
                    let then = if have == 0 {
                        "no keys yet: its tokens are refused until a fetch succeeds"
                    } else {
                        "serving the last good keys"
                    };
                    tracing::warn!(
                        source = %shown,
                        keys_kept = have,
                        "cannot fetch token signing keys: {e}; {then}"
                    );
                }
                h.failing = Some(e);
                let wait = backoff;
                // A set that never had keys refuses every token: retried sooner.
                let most = if have == 0 {
                    NO_KEYS_BACKOFF
                } else {
                    MAX_BACKOFF
                };
                backoff = (backoff * 2).min(most);
                wait
            }
        };
        s.health.lock().next = Some(started + wait);
        s.fetch_ended();
        drop(s);
        tokio::select! {
            _ = tokio::time::sleep_until(started + wait) => {}
            // An unknown key id (or the set dropped): fetch now, but never sooner than
            // MIN_REFETCH after the last fetch started. The backoff of a failing issuer
            // spaces the scheduled tries only: a key published while it failed is fetched
            // on its first token, as when it did not (one try per 10 s at most).
            _ = wake.notified() => {
                if set.strong_count() > 0 {
                    tokio::time::sleep_until(started + MIN_REFETCH).await;
                }
            }
        }
    }
}

/// Whether two sets were read from the same text.
fn same(a: &Keys, b: &Keys) -> bool {
    a.text == b.text
}

/// One fetch: the metadata first when discovering, then the set. Returns the keys and how
/// long they stay fresh.
async fn fetch(client: &HttpClient, url: &str, discover: bool) -> Result<(Keys, Duration), String> {
    let jwks_url = if discover {
        let meta_url = format!(
            "{}/.well-known/openid-configuration",
            url.trim_end_matches('/')
        );
        let (body, _) = get(client, &meta_url).await?;
        let meta_url = redacted_url(&meta_url);
        #[derive(serde::Deserialize)]
        struct Meta {
            issuer: Option<String>,
            jwks_uri: Option<String>,
        }
        let meta: Meta = serde_json::from_slice(&body)
            .map_err(|e| format!("{meta_url}: not OpenID metadata: {e}"))?;
        // OpenID Connect Discovery §4.3: the metadata's issuer is exactly the one asked
        // for (it is what tokens' `iss` must say).
        match &meta.issuer {
            Some(i) if i == url => {}
            Some(i) => {
                return Err(format!(
                    "{meta_url}: names issuer {:?}, not {:?}",
                    redacted_url(i),
                    redacted_url(url)
                ))
            }
            None => return Err(format!("{meta_url}: no `issuer`")),
        }
        let jwks = meta
            .jwks_uri
            .ok_or_else(|| format!("{meta_url}: no `jwks_uri`"))?;
        // Metadata fetched over TLS does not send the keys' fetch to plain HTTP.
        if url.starts_with("https://") && !jwks.starts_with("https://") {
            return Err(format!(
                "{meta_url}: `jwks_uri` {:?} is not https://",
                redacted_url(&jwks)
            ));
        }
        jwks
    } else {
        url.to_string()
    };
    let (body, fresh) = get(client, &jwks_url).await?;
    let jwks_url = redacted_url(&jwks_url);
    let text = std::str::from_utf8(&body).map_err(|_| format!("{jwks_url}: not UTF-8"))?;
    let keys = keys_of(text).map_err(|e| format!("{jwks_url}: {e}"))?;
    if keys.list.is_empty() {
        return Err(format!("{jwks_url}: no signature key the gateway can use"));
    }
    Ok((keys, fresh))
}

/// GETs `url`: its body (up to [`MAX_BODY`]) and how long its `Cache-Control` lets it be
/// kept. User info in the URL (`https://user:password@host/…`) is sent as Basic
/// credentials, as curl and browsers send it, and never shown in an error.
async fn get(client: &HttpClient, url: &str) -> Result<(Bytes, Duration), String> {
    let shown = redacted_url(url);
    let (uri, basic) = split_credentials(url).map_err(|e| format!("{shown}: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(format!("{shown}: not an http:// or https:// URL"));
    }
    let mut req = Request::get(uri)
        .header(header::ACCEPT, "application/json")
        .header(header::USER_AGENT, "tollgate");
    if let Some(basic) = basic {
        req = req.header(header::AUTHORIZATION, basic);
    }
    let req = req
        .body(Empty::new())
        .map_err(|e| format!("{shown}: {e}"))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("{shown}: {}", with_causes(&e)))?;
    if resp.status() != StatusCode::OK {
        return Err(format!("{shown}: answered {}", resp.status()));
    }
    let fresh = freshness(resp.headers());
    let body = Limited::new(resp.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| format!("{shown}: {e}"))?
        .to_bytes();
    Ok((body, fresh))
}

/// The URL to ask without its user info, and that user info as a Basic `Authorization`
/// value (percent-decoded, RFC 7617) when it has some.
fn split_credentials(url: &str) -> Result<(Uri, Option<HeaderValue>), String> {
    let mut u = url::Url::parse(url).map_err(|e| e.to_string())?;
    let basic = if u.username().is_empty() && u.password().is_none() {
        None
    } else {
        use base64::Engine;
        // Percent-decoded as a path is: `+` is itself here, not a space.
        let decode = |s: &str| crate::query::percent_decode(&s.replace('+', "%2B")).into_owned();
        let pair = format!(
            "{}:{}",
            decode(u.username()),
            decode(u.password().unwrap_or(""))
        );
        let value = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(pair)
        );
        let mut value = HeaderValue::from_str(&value).map_err(|e| e.to_string())?;
        value.set_sensitive(true);
        // Both parts are set through the URL's own setters: they cannot fail on an
        // http(s) URL with a host, which the config requires.
        let _ = u.set_username("");
        let _ = u.set_password(None);
        Some(value)
    };
    let uri = u.as_str().parse::<Uri>().map_err(|e| e.to_string())?;
    Ok((uri, basic))
}

/// An error with what caused it (`client error (Connect): invalid peer certificate:
/// UnknownIssuer`), not its outer words alone, which are the same for a refused
/// connection and a certificate not trusted.
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let said = c.to_string();
        if !out.contains(&said) {
            out.push_str(": ");
            out.push_str(&said);
        }
        cause = c.source();
    }
    out
}

/// How long a set may be kept: its `max-age` between [`MIN_REFETCH`] and [`MAX_FRESH`],
/// the least for `no-cache`/`no-store`, else [`DEFAULT_FRESH`].
pub(super) fn freshness(headers: &http::HeaderMap) -> Duration {
    let mut out = None;
    for v in headers.get_all(header::CACHE_CONTROL) {
        let Ok(v) = v.to_str() else { continue };
        for d in v.split(',').map(str::trim) {
            let (name, arg) = d.split_once('=').unwrap_or((d, ""));
            if name.eq_ignore_ascii_case("no-store") || name.eq_ignore_ascii_case("no-cache") {
                return MIN_REFETCH;
            }
            if name.eq_ignore_ascii_case("max-age") {
                if let Ok(secs) = arg.trim_matches('"').parse::<u64>() {
                    out = Some(Duration::from_secs(secs));
                }
            }
        }
    }
    out.unwrap_or(DEFAULT_FRESH).clamp(MIN_REFETCH, MAX_FRESH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fetch_error_says_its_causes() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("client error (Connect)")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Outer(std::io::Error::other(
            "invalid peer certificate: UnknownIssuer",
        ));
        assert_eq!(
            with_causes(&e),
            "client error (Connect): invalid peer certificate: UnknownIssuer"
        );
    }

    #[test]
    fn freshness_follows_max_age_within_bounds() {
        let with = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(header::CACHE_CONTROL, v.parse().expect("value"));
            freshness(&h)
        };
        assert_eq!(freshness(&http::HeaderMap::new()), DEFAULT_FRESH);
        assert_eq!(with("public, max-age=3600"), Duration::from_secs(3600));
        assert_eq!(with("max-age=0"), MIN_REFETCH);
        assert_eq!(with("max-age=99999999"), MAX_FRESH);
        assert_eq!(with("no-store, max-age=600"), MIN_REFETCH);
        assert_eq!(with("max-age=abc"), DEFAULT_FRESH);
    }
}
