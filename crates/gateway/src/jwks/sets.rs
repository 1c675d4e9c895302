//! Every key set in use, by source: routes naming the same source share one set, and a set
//! outlives reloads while a snapshot uses it.

use super::fetch;
use super::keys::{keys_of, Key, KeySet, Keys};
use jsonwebtoken::DecodingKey;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};
use tollgate_config::JwtKeys;

/// Every key set in use, by source, shared by the snapshots.
#[derive(Debug, Default)]
pub struct KeyRing {
    sets: Mutex<HashMap<JwtKeys, Weak<KeySet>>>,
}

impl KeyRing {
    /// The set of `source` (fetched with `timeout`), reused if a snapshot has it already
    /// (keys, and the last good ones, carry over a reload; the timeout is the newest);
    /// a new fetched set starts its fetcher on the current Tokio runtime.
    pub fn get(&self, source: &JwtKeys, timeout: Duration, label: &str) -> Arc<KeySet> {
        super::crypto::install();
        let mut sets = self.sets.lock();
        sets.retain(|_, w| w.strong_count() > 0);
        if let Some(set) = sets.get(source).and_then(Weak::upgrade) {
            set.set_timeout(timeout);
            return set;
        }
        let set = match source {
            JwtKeys::Secret(secret) => {
                let keys = Keys {
                    list: vec![Key {
                        kid: None,
                        alg: None,
                        key: DecodingKey::from_secret(secret),
                    }],
                    secret: true,
                    text: 0,
                };
                let set = Arc::new(KeySet::new(label.to_string(), keys));
                set.health.lock().last_ok = Some(SystemTime::now());
                set.settle();
                set
            }
            JwtKeys::File(text) => {
                let keys = match keys_of(text) {
                    Ok(keys) if keys.list.is_empty() => {
                        tracing::error!(source = %label, "JWKS file: {}", super::keys::NO_USABLE_KEY);
                        keys
                    }
                    Ok(keys) => keys,
                    Err(e) => {
                        tracing::error!(source = %label, "JWKS file: {e}");
                        Keys::default()
                    }
                };
                let set = Arc::new(KeySet::new(label.to_string(), keys));
                set.health.lock().last_ok = Some(SystemTime::now());
                set.settle();
                set
            }
            JwtKeys::Url(url) | JwtKeys::Discovery(url) => {
                let set = Arc::new(KeySet::new(
                    tollgate_config::redacted_url(url),
                    Keys::default(),
                ));
                // Before the fetcher starts: its first fetch reads it.
                set.set_timeout(timeout);
                let discover = matches!(source, JwtKeys::Discovery(_));
                match tokio::runtime::Handle::try_current() {
                    Ok(rt) => {
                        set.is_fetched();
                        rt.spawn(fetch::run(
                            Arc::downgrade(&set),
                            set.wake.clone(),
                            url.clone(),
                            discover,
                        ));
                    }
                    Err(_) => set.settle(),
                }
                set
            }
        };
        set.set_timeout(timeout);
        sets.insert(source.clone(), Arc::downgrade(&set));
        set
    }

    /// The sets in use now.
    pub(super) fn live(&self) -> Vec<Arc<KeySet>> {
        self.sets
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect()
    }
}
