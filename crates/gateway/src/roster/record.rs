//! A consumer as the admin API manages it: one record holds the whole consumer (plan, keys
//! as SHA-256 digests, metadata) or says it was deleted, so the change log needs no
//! history to be read: the last record of a name is that consumer.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One consumer, as the admin API last wrote it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Managed {
    /// Its name.
    pub name: String,
    /// Its plan, by name (`None`: no plan).
    #[serde(default)]
    pub plan: Option<String>,
    /// Keys made or given through the API, as digests.
    #[serde(default)]
    pub keys: Vec<ManagedKey>,
    /// Whatever the provider keeps with it.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub metadata: Map<String, Value>,
    /// Deleted: the consumer is refused, whatever the config lists.
    #[serde(default, skip_serializing_if = "is_false")]
    pub deleted: bool,
    /// Put again after it was deleted: the keys the config lists under its name stay
    /// refused (the deletion revoked them, as Kong's does a consumer's credentials); only
    /// the keys given through the API name it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub without_config_keys: bool,
    /// Orders changes to one name: the higher wins (milliseconds since the epoch, times
    /// 1024, plus a count within the millisecond).
    pub version: u64,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A key of a managed consumer: only its digest is kept.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ManagedKey {
    /// Names the key for revocation (the digest's first 12 hex digits).
    pub id: String,
    /// SHA-256 of the key, 64 hex digits.
    pub sha256: String,
    /// When it was added, seconds since the epoch.
    pub created: u64,
}

/// Exactly 64 hex digits → a digest (the config's reading of `key_sha256`, without its
/// tolerance of surrounding spaces: a record holds what the API wrote).
pub fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    (hex.len() == 64)
        .then(|| tollgate_config::parse_digest(hex))
        .flatten()
}

/// A digest as 64 lowercase hex digits.
pub fn hex(d: &[u8; 32]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(64);
    for b in d {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Whether `name` may name a consumer: 1 to 256 visible ASCII characters, no quote,
/// backslash or `/` (it is a path segment of the admin API), and not `-` (no consumer).
pub fn valid_name(name: &str) -> bool {
    name != tollgate_config::NO_CONSUMER
        && !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| (0x21..0x7f).contains(&b) && !matches!(b, b'"' | b'\\' | b'/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_round_trip_and_names_are_checked() {
        let d = [0xab; 32];
        assert_eq!(parse_digest(&hex(&d)), Some(d));
        assert_eq!(parse_digest("ab"), None);
        assert_eq!(parse_digest(&"zz".repeat(32)), None);
        assert!(valid_name("alice@example.com"));
        assert!(!valid_name("a/b") && !valid_name("") && !valid_name("a b"));
        assert!(!valid_name("-") && valid_name("--"));
        let r = Managed {
            name: "alice".into(),
            plan: None,
            keys: vec![],
            metadata: Map::new(),
            deleted: false,
            without_config_keys: false,
            version: 1,
        };
        let line = serde_json::to_string(&r).expect("json");
        assert_eq!(
            line,
            r#"{"name":"alice","plan":null,"keys":[],"version":1}"#
        );
        assert_eq!(serde_json::from_str::<Managed>(&line).expect("back"), r);
    }
}
