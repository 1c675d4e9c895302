//! A source's keys: each key with its id and algorithm, the set swapped whole when it
//! changes, and what the fetches of it have done.

use arc_swap::ArcSwap;
use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{Algorithm, DecodingKey};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::Notify;
use tokio::time::Instant;
use tollgate_config::JwtAlgorithm;

/// Fewest seconds between two fetches of one set, for any reason.
pub const MIN_REFETCH: Duration = Duration::from_secs(10);

/// Longest a request whose token names a key the set lacks waits for the set's fetch.
pub const MAX_MISS_WAIT: Duration = Duration::from_secs(5);

/// One verification key.
pub struct Key {
    /// Its `kid`, if the set names it.
    pub kid: Option<String>,
    /// The one algorithm it may verify, if the set says (`alg`).
    pub alg: Option<Algorithm>,
    /// The key.
    pub key: DecodingKey,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Key")
            .field("kid", &self.kid)
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

/// The keys of a set at one time.
#[derive(Debug, Default)]
pub struct Keys {
    /// Every usable key (signature keys of a kind the gateway verifies).
    pub list: Vec<Key>,
    /// Whether the keys are an HMAC secret (any `kid` is accepted).
    pub secret: bool,
    /// A hash of the set's text: a fetch that brings the same text changes nothing.
    pub(super) text: u64,
}

/// What a source's fetches have done, for the log and `/metrics`.
#[derive(Debug, Default)]
pub(super) struct Health {
    pub(super) fetched: u64,
    pub(super) failed: u64,
    /// When keys were last fetched (or read) successfully.
    pub(super) last_ok: Option<SystemTime>,
    /// The last failure, while the source is failing.
    pub(super) failing: Option<String>,
    /// When the next scheduled fetch is due.
    pub(super) next: Option<Instant>,
    /// When a fetch last started.
    pub(super) last_try: Option<Instant>,
}

/// A source's keys, swapped whole when they change.
#[derive(Debug)]
pub struct KeySet {
    /// The source, as `/metrics` labels it (a URL or a file's place in the config).
    pub label: String,
    /// Its place among the sets this process made: sets shown alike keep their order.
    pub(super) made: u64,
    keys: ArcSwap<Keys>,
    /// Bumped when the keys change: tokens remembered under an older generation are
    /// verified again.
    pub(super) generation: AtomicU64,
    pub(super) health: Mutex<Health>,
    /// Wakes the fetcher early (a token named an unknown key).
    pub(super) wake: Arc<Notify>,
    /// Set when the first fetch has ended, well or not.
    settled: AtomicBool,
    /// Woken whenever a fetch ends, well or not.
    settled_wake: Notify,
    /// Fetches ended, well or not.
    fetches: AtomicU64,
    /// Whether a fetch is under way.
    fetching: AtomicBool,
    /// Whether the set is fetched (from a URL or through discovery) by a fetcher.
    fetched: AtomicBool,
    /// How long one fetch may take, in milliseconds (the newest config's).
    timeout_ms: AtomicU64,
}

impl Drop for KeySet {
    fn drop(&mut self) {
        // The fetcher waits on this: it wakes, finds the set gone and ends.
        self.wake.notify_one();
    }
}

impl KeySet {
    pub(super) fn new(label: String, keys: Keys) -> KeySet {
        static MADE: AtomicU64 = AtomicU64::new(0);
        KeySet {
            label,
            made: MADE.fetch_add(1, Ordering::Relaxed),
            keys: ArcSwap::from_pointee(keys),
            generation: AtomicU64::new(0),
            health: Mutex::default(),
            wake: Arc::new(Notify::new()),
            settled: AtomicBool::new(false),
            settled_wake: Notify::new(),
            fetches: AtomicU64::new(0),
            fetching: AtomicBool::new(false),
            fetched: AtomicBool::new(false),
            timeout_ms: AtomicU64::new(10_000),
        }
    }

    /// How long one fetch may take.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    pub(super) fn set_timeout(&self, t: Duration) {
        let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1);
        self.timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// The keys now.
    pub fn keys(&self) -> arc_swap::Guard<Arc<Keys>> {
        self.keys.load()
    }

    /// Changes whenever the keys do.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// A token named a key the set lacks: fetch the set again, as soon as
    /// [`MIN_REFETCH`] has passed since the last fetch started (misses meanwhile make one
    /// fetch). Returns at once; the request is refused.
    pub fn missed(&self) {
        self.wake.notify_one();
    }

    /// [`KeySet::missed`], for a request that may wait: when the set is fetched from a
    /// source that answers (its last fetch did not fail) and a fetch is under way or
    /// starts at once (the last began [`MIN_REFETCH`] ago or more), the fetches ended so
    /// far, for [`KeySet::fetched_since`]; the request is checked again once the next
    /// ends. Otherwise `None`: the request is refused now (a key file is never fetched,
    /// and a failing issuer would hold every such request for its timeout).
    pub fn missed_with_wait(&self) -> Option<u64> {
        self.missed();
        if !self.fetched.load(Ordering::Acquire) {
            return None;
        }
        // Read before the flag: a fetch that ends in between counts as the one awaited.
        let seen = self.fetches.load(Ordering::Acquire);
        let soon = {
            let h = self.health.lock();
            h.failing.is_none()
                && (self.fetching.load(Ordering::Acquire)
                    || h.last_try.is_none_or(|t| t.elapsed() >= MIN_REFETCH))
        };
        soon.then_some(seen)
    }

    /// Waits until more than `seen` fetches have ended, at most the fetch's timeout (and
    /// [`MAX_MISS_WAIT`]).
    pub async fn fetched_since(&self, seen: u64) {
        // The fetcher may first sleep out the rest of MIN_REFETCH: a little slack.
        let wait = self.timeout().min(MAX_MISS_WAIT) + Duration::from_millis(100);
        let _ = tokio::time::timeout(wait, async {
            loop {
                let ended = self.settled_wake.notified();
                if self.fetches.load(Ordering::Acquire) > seen {
                    return;
                }
                ended.await;
            }
        })
        .await;
    }

    /// The set has a fetcher: a key it lacks may be waited for.
    pub(super) fn is_fetched(&self) {
        self.fetched.store(true, Ordering::Release);
    }

    /// A fetch begins (the fetcher's).
    pub(super) fn fetch_begins(&self) {
        self.fetching.store(true, Ordering::Release);
    }

    /// A fetch ended, well or not (the fetcher's): requests waiting on it check again.
    pub(super) fn fetch_ended(&self) {
        self.fetching.store(false, Ordering::Release);
        self.fetches.fetch_add(1, Ordering::AcqRel);
        self.settle();
    }

    /// Waits until the first fetch has ended (at most `wait`): a gateway starting up
    /// serves token routes with their keys.
    pub async fn settled(&self, wait: Duration) {
        let _ = tokio::time::timeout(wait, async {
            loop {
                let notified = self.settled_wake.notified();
                if self.settled.load(Ordering::Acquire) {
                    return;
                }
                notified.await;
            }
        })
        .await;
    }

    pub(super) fn settle(&self) {
        self.settled.store(true, Ordering::Release);
        self.settled_wake.notify_waiters();
    }

    pub(super) fn store(&self, keys: Keys) {
        self.keys.store(Arc::new(keys));
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// The JOSE algorithm of a config's algorithm name.
pub fn algorithm(a: JwtAlgorithm) -> Algorithm {
    match a {
        JwtAlgorithm::HS256 => Algorithm::HS256,
        JwtAlgorithm::HS384 => Algorithm::HS384,
        JwtAlgorithm::HS512 => Algorithm::HS512,
        JwtAlgorithm::RS256 => Algorithm::RS256,
        JwtAlgorithm::RS384 => Algorithm::RS384,
        JwtAlgorithm::RS512 => Algorithm::RS512,
        JwtAlgorithm::PS256 => Algorithm::PS256,
        JwtAlgorithm::PS384 => Algorithm::PS384,
        JwtAlgorithm::PS512 => Algorithm::PS512,
        JwtAlgorithm::ES256 => Algorithm::ES256,
        JwtAlgorithm::ES384 => Algorithm::ES384,
        JwtAlgorithm::EdDSA => Algorithm::EdDSA,
    }
}

/// The usable keys of a set (its JSON): public signature keys of a kind the gateway
/// verifies. A key of another kind (an encryption key, a curve not supported) is left out
/// rather than failing the set, and so are symmetric (`oct`) keys: a published set holds
/// public keys only, and an HMAC key in it would let anyone who reads it sign.
pub(super) fn keys_of(json: &str) -> Result<Keys, String> {
    let (keys, weak) = keys_counted(json)?;
    if weak > 0 {
        tracing::warn!("{}", weak_said(weak));
    }
    Ok(keys)
}

/// What is said of `weak` RSA keys left out of a set.
pub(super) fn weak_said(weak: usize) -> String {
    format!("{weak} RSA key(s) shorter than 2048 bits left out of a key set: tokens they sign are refused")
}

/// The usable keys of a JWK set, and how many RSA keys were left out as too short.
pub(super) fn keys_counted(json: &str) -> Result<(Keys, usize), String> {
    #[derive(serde::Deserialize)]
    struct Set {
        keys: Vec<serde_json::Value>,
    }
    let set: Set = serde_json::from_str(json).map_err(|e| format!("not a JWK set: {e}"))?;
    let mut weak = 0;
    let list = set
        .keys
        .into_iter()
        .filter_map(|k| serde_json::from_value::<Jwk>(k).ok())
        .filter_map(|k| key_of(&k))
        .filter(|k| {
            // What the signature check refuses (ring takes 2048 to 8192 bits): left out
            // and said, rather than kept to fail every token as a bad signature.
            let short = rsa_bits(&k.key).is_some_and(|b| b < 2048);
            weak += usize::from(short);
            !short
        })
        .collect();
    let text = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        json.hash(&mut h);
        h.finish()
    };
    Ok((
        Keys {
            list,
            secret: false,
            text,
        },
        weak,
    ))
}

/// What is said of a key file that leaves nothing to verify with.
pub(crate) const NO_USABLE_KEY: &str = "no key the gateway can verify with; its tokens are refused";

/// What a route's `jwks_file` gives the gateway to verify with, said as a start logs it:
/// RSA keys too short to use, and a file that leaves no key at all.
pub fn file_findings(text: &str) -> Vec<String> {
    match keys_counted(text) {
        Err(e) => vec![e],
        Ok((keys, weak)) => {
            let mut said = Vec::new();
            if weak > 0 {
                said.push(weak_said(weak));
            }
            if keys.list.is_empty() {
                said.push(NO_USABLE_KEY.to_string());
            }
            said
        }
    }
}

/// The length in bits of an RSA key's modulus; `None` for other keys.
fn rsa_bits(key: &DecodingKey) -> Option<usize> {
    let jsonwebtoken::DecodingKeyKind::RsaModulusExponent { n, .. } = key.kind() else {
        return None;
    };
    let at = n.iter().position(|&b| b != 0)?;
    let lead = n.get(at).copied().unwrap_or(0);
    Some((n.len() - at - 1) * 8 + (8 - lead.leading_zeros() as usize))
}

fn key_of(jwk: &Jwk) -> Option<Key> {
    use jsonwebtoken::jwk::{AlgorithmParameters, PublicKeyUse};
    if matches!(jwk.algorithm, AlgorithmParameters::OctetKey(_)) {
        return None;
    }
    if jwk
        .common
        .public_key_use
        .as_ref()
        .is_some_and(|u| *u != PublicKeyUse::Signature)
    {
        return None;
    }
    // A key whose `key_ops` are listed is used for those only (RFC 7517 §4.3).
    if jwk
        .common
        .key_operations
        .as_ref()
        .is_some_and(|ops| !ops.contains(&jsonwebtoken::jwk::KeyOperations::Verify))
    {
        return None;
    }
    let alg = match jwk.common.key_algorithm {
        None => None,
        Some(a) => Some(a.to_string().parse::<Algorithm>().ok()?),
    };
    // An elliptic curve verifies one algorithm (RFC 7518 §3.4): a token naming another
    // finds no key, rather than failing as a bad signature. A set that says otherwise is
    // wrong about its key: left out.
    let by_curve = match &jwk.algorithm {
        AlgorithmParameters::EllipticCurve(p) => match p.curve {
            jsonwebtoken::jwk::EllipticCurve::P256 => Some(Algorithm::ES256),
            jsonwebtoken::jwk::EllipticCurve::P384 => Some(Algorithm::ES384),
            _ => None,
        },
        _ => None,
    };
    let alg = match (alg, by_curve) {
        (Some(a), Some(c)) if a != c => return None,
        (a, c) => a.or(c),
    };
    let key = DecodingKey::from_jwk(jwk).ok()?;
    Some(Key {
        kid: jwk.common.key_id.clone(),
        alg,
        key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_tried(ago: Duration) -> Arc<KeySet> {
        let set = Arc::new(KeySet::new("t".into(), Keys::default()));
        set.is_fetched();
        set.health.lock().last_try = Instant::now().checked_sub(ago);
        set
    }

    #[test]
    fn rsa_keys_under_2048_bits_are_left_out_of_a_set() {
        use base64::Engine;
        let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let jwk = |kid: &str, bits: usize| {
            let mut n = vec![0xC5u8; bits / 8];
            n[bits / 8 - 1] |= 1;
            format!(
                r#"{{"kty":"RSA","kid":"{kid}","n":"{}","e":"AQAB"}}"#,
                b64(&n)
            )
        };
        let json = format!(
            r#"{{"keys":[{},{}]}}"#,
            jwk("short", 1024),
            jwk("long", 2048)
        );
        let keys = keys_of(&json).expect("a set");
        let kids: Vec<_> = keys.list.iter().map(|k| k.kid.as_deref()).collect();
        assert_eq!(kids, [Some("long")]);
        assert_eq!(rsa_bits(&keys.list[0].key), Some(2048));
    }

    #[test]
    fn a_key_for_encryption_only_is_left_out_of_a_set() {
        use base64::Engine;
        let n = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode([0xC5u8; 256]);
        let jwk = |kid: &str, more: &str| {
            format!(r#"{{"kty":"RSA","kid":"{kid}","n":"{n}","e":"AQAB"{more}}}"#)
        };
        let json = format!(
            r#"{{"keys":[{},{},{},{},{}]}}"#,
            jwk("plain", ""),
            jwk("sig", r#","use":"sig""#),
            jwk("enc", r#","use":"enc""#),
            jwk("verify", r#","key_ops":["verify"]"#),
            jwk("encrypt", r#","key_ops":["encrypt","wrapKey"]"#),
        );
        let keys = keys_of(&json).expect("a set");
        let kids: Vec<_> = keys.list.iter().map(|k| k.kid.as_deref()).collect();
        assert_eq!(kids, [Some("plain"), Some("sig"), Some("verify")]);
    }

    #[tokio::test]
    async fn a_miss_waits_only_for_a_fetch_under_way_or_starting_at_once() {
        // The last fetch began 11 s ago: the miss starts one at once, and waits for it.
        let set = set_tried(Duration::from_secs(11));
        let seen = set.missed_with_wait().expect("a fetch starts at once");
        let wait = set.fetched_since(seen);
        let fetcher = {
            let set = set.clone();
            tokio::spawn(async move {
                set.fetch_begins();
                set.fetch_ended();
            })
        };
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("the wait ends with the fetch");
        fetcher.await.expect("fetcher");
        // Just after it, the next fetch is 10 s off: no wait.
        set.health.lock().last_try = Some(Instant::now());
        assert!(set.missed_with_wait().is_none());
        // A fetch under way is waited for, however recent it is.
        set.fetch_begins();
        let seen = set.missed_with_wait().expect("a fetch under way");
        set.fetch_ended();
        let wait = set.fetched_since(seen);
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("the wait ends with the fetch");
        // An issuer whose last fetch failed is not waited for, nor is a key file.
        set.health.lock().last_try = Instant::now().checked_sub(Duration::from_secs(11));
        set.health.lock().failing = Some("down".into());
        assert!(set.missed_with_wait().is_none());
        let file = Arc::new(KeySet::new("file".into(), Keys::default()));
        assert!(file.missed_with_wait().is_none());
    }
}
