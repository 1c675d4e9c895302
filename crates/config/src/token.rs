//! `auth.jwt:` validated: where a route's token signing keys come from and what a token
//! must hold.

use http::HeaderName;
use std::time::Duration;

/// A JWS signing algorithm a route may accept (`none` never is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JwtAlgorithm {
    /// HMAC with SHA-256.
    HS256,
    /// HMAC with SHA-384.
    HS384,
    /// HMAC with SHA-512.
    HS512,
    /// RSASSA-PKCS1-v1_5 with SHA-256.
    RS256,
    /// RSASSA-PKCS1-v1_5 with SHA-384.
    RS384,
    /// RSASSA-PKCS1-v1_5 with SHA-512.
    RS512,
    /// RSASSA-PSS with SHA-256.
    PS256,
    /// RSASSA-PSS with SHA-384.
    PS384,
    /// RSASSA-PSS with SHA-512.
    PS512,
    /// ECDSA on P-256 with SHA-256.
    ES256,
    /// ECDSA on P-384 with SHA-384.
    ES384,
    /// Ed25519.
    EdDSA,
}

impl JwtAlgorithm {
    /// Every algorithm, by its JOSE name.
    pub const ALL: [(&'static str, JwtAlgorithm); 12] = [
        ("HS256", JwtAlgorithm::HS256),
        ("HS384", JwtAlgorithm::HS384),
        ("HS512", JwtAlgorithm::HS512),
        ("RS256", JwtAlgorithm::RS256),
        ("RS384", JwtAlgorithm::RS384),
        ("RS512", JwtAlgorithm::RS512),
        ("PS256", JwtAlgorithm::PS256),
        ("PS384", JwtAlgorithm::PS384),
        ("PS512", JwtAlgorithm::PS512),
        ("ES256", JwtAlgorithm::ES256),
        ("ES384", JwtAlgorithm::ES384),
        ("EdDSA", JwtAlgorithm::EdDSA),
    ];

    /// Whether it is signed with a shared secret (HMAC) rather than a key pair.
    pub fn symmetric(self) -> bool {
        matches!(
            self,
            JwtAlgorithm::HS256 | JwtAlgorithm::HS384 | JwtAlgorithm::HS512
        )
    }

    /// The shortest secret an HMAC algorithm may be used with: its hash's size (RFC 7518
    /// §3.2); 0 for the others.
    pub fn min_secret(self) -> usize {
        match self {
            JwtAlgorithm::HS256 => 32,
            JwtAlgorithm::HS384 => 48,
            JwtAlgorithm::HS512 => 64,
            _ => 0,
        }
    }
}

/// Where a route's token signing keys come from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum JwtKeys {
    /// The issuer's OpenID metadata (`{issuer}/.well-known/openid-configuration`) names
    /// the JWKS.
    Discovery(String),
    /// A JWKS fetched from this URL.
    Url(String),
    /// A JWKS read from disk when the config is loaded (its content).
    File(std::sync::Arc<str>),
    /// An HMAC secret read from disk when the config is loaded.
    Secret(std::sync::Arc<[u8]>),
}

/// `auth.jwt`, validated.
#[derive(Debug, Clone)]
pub struct JwtConfig {
    /// Where the keys come from.
    pub keys: JwtKeys,
    /// The `iss` every token must carry, when the route names an issuer.
    pub issuer: Option<String>,
    /// One of these must be in the token's `aud` (none given: `aud` is not checked).
    pub audiences: Vec<String>,
    /// Accepted algorithms.
    pub algorithms: Vec<JwtAlgorithm>,
    /// The claim naming the consumer.
    pub consumer_claim: String,
    /// The claim naming the plan of a caller who is not a listed consumer.
    pub plan_claim: Option<String>,
    /// The plan (index into the config's plans) of a caller who is not a listed consumer.
    pub anonymous_plan: Option<usize>,
    /// Tolerance on `exp` and `nbf`.
    pub clock_skew: Duration,
    /// Forward `Authorization` upstream.
    pub forward_token: bool,
    /// Headers set from claims.
    pub claims_to_headers: Vec<(HeaderName, String)>,
    /// Longest token accepted.
    pub max_token_bytes: usize,
    /// Timeout of one fetch of the JWKS or the issuer's metadata.
    pub fetch_timeout: Duration,
    /// The `jwks_file` or `secret_file` read, with the fingerprint of what it held then.
    pub key_file: Option<(std::path::PathBuf, u64)>,
}
