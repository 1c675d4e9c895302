//! The keys that sign a route's bearer tokens: a JSON Web Key Set fetched from the issuer
//! (directly, or through its OpenID metadata), read from a file, or an HMAC secret.
//!
//! A fetched set is refreshed as its `Cache-Control: max-age` says (5 minutes without one,
//! never more often than every 10 s nor less than once a day), and fetched again when a
//! token names a key id the set lacks, at most once per 10 s. When the issuer cannot be
//! reached the last good keys keep serving; the log and `/metrics` say so. Sets are shared
//! by every route naming the same source and kept across reloads ([`KeyRing`]).

mod crypto;
mod fetch;
mod keys;
mod report;
mod sets;
mod tokens;

pub use crypto::install as install_crypto;
pub use keys::{algorithm, file_findings, Key, KeySet};
pub use sets::KeyRing;
pub use tokens::{TokenCache, Verified};
