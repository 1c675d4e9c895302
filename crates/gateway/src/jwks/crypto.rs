//! Signature checks of key-pair tokens on `ring`, the library the gateway's TLS already
//! uses: RSA verification there costs a fraction of the pure-Rust one (measured in
//! docs/benchmarks.md, "Bearer tokens"), and every token the gateway has not seen costs
//! one. HMAC tokens, signing (the tests') and JWK helpers stay with jsonwebtoken's own
//! provider. ring refuses RSA keys under 2048 bits.

use jsonwebtoken::crypto::rust_crypto::DEFAULT_PROVIDER as PURE;
use jsonwebtoken::crypto::{CryptoProvider, JwtSigner, JwtVerifier, KeyUtils};
use jsonwebtoken::errors::{ErrorKind, Result};
use jsonwebtoken::jwk::{EllipticCurve, ThumbprintHash};
use jsonwebtoken::signature::{Error, Verifier};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, DecodingKeyKind, EncodingKey};
use ring::signature as sig;

/// jsonwebtoken's provider, with ring verifying RSA, ECDSA and EdDSA signatures.
pub static PROVIDER: CryptoProvider = CryptoProvider {
    signer_factory: signer,
    verifier_factory: verifier,
    key_utils: KeyUtils {
        rsa_pub_components_from_private_key: rsa_private,
        rsa_pub_components_from_public_key: rsa_public,
        ec_pub_components_from_private_key: ec_private,
        ed_pub_components_from_private_key: ed_private,
        compute_digest: digest,
    },
};

/// Makes [`PROVIDER`] the process's, unless one was chosen already (then that one
/// verifies: the same answers, at its cost).
pub fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if PROVIDER.install_default().is_err() {
            tracing::debug!(
                "jsonwebtoken's provider was chosen before; tokens are verified with it"
            );
        }
    });
}

/// One key-pair signature check on ring.
struct RingVerifier {
    alg: Algorithm,
    key: DecodingKey,
}

impl Verifier<Vec<u8>> for RingVerifier {
    fn verify(&self, msg: &[u8], signature: &Vec<u8>) -> std::result::Result<(), Error> {
        let bad = |_| Error::new();
        match (self.alg.family(), self.key.kind()) {
            (AlgorithmFamily::Rsa, DecodingKeyKind::RsaModulusExponent { n, e }) => {
                sig::RsaPublicKeyComponents { n, e }
                    .verify(rsa_params(self.alg).ok_or_else(Error::new)?, msg, signature)
                    .map_err(bad)
            }
            (AlgorithmFamily::Rsa, DecodingKeyKind::SecretOrDer(der)) => {
                let params = rsa_params(self.alg).ok_or_else(Error::new)?;
                sig::UnparsedPublicKey::new(params, der)
                    .verify(msg, signature)
                    .map_err(bad)
            }
            (AlgorithmFamily::Ec | AlgorithmFamily::Ed, DecodingKeyKind::SecretOrDer(point)) => {
                let alg: &'static dyn sig::VerificationAlgorithm = match self.alg {
                    Algorithm::ES256 => &sig::ECDSA_P256_SHA256_FIXED,
                    Algorithm::ES384 => &sig::ECDSA_P384_SHA384_FIXED,
                    Algorithm::EdDSA => &sig::ED25519,
                    _ => return Err(Error::new()),
                };
                sig::UnparsedPublicKey::new(alg, point)
                    .verify(msg, signature)
                    .map_err(bad)
            }
            _ => Err(Error::new()),
        }
    }
}

impl JwtVerifier for RingVerifier {
    fn algorithm(&self) -> Algorithm {
        self.alg
    }
}

fn rsa_params(alg: Algorithm) -> Option<&'static sig::RsaParameters> {
    Some(match alg {
        Algorithm::RS256 => &sig::RSA_PKCS1_2048_8192_SHA256,
        Algorithm::RS384 => &sig::RSA_PKCS1_2048_8192_SHA384,
        Algorithm::RS512 => &sig::RSA_PKCS1_2048_8192_SHA512,
        Algorithm::PS256 => &sig::RSA_PSS_2048_8192_SHA256,
        Algorithm::PS384 => &sig::RSA_PSS_2048_8192_SHA384,
        Algorithm::PS512 => &sig::RSA_PSS_2048_8192_SHA512,
        _ => return None,
    })
}

fn verifier(alg: &Algorithm, key: &DecodingKey) -> Result<Box<dyn JwtVerifier>> {
    if alg.family() == AlgorithmFamily::Hmac {
        return (PURE.verifier_factory)(alg, key);
    }
    // An algorithm checks only a key of its own kind (no RSA key read as an HMAC secret,
    // no EC point as an RSA modulus).
    if key.family() != alg.family() {
        return Err(ErrorKind::InvalidAlgorithm.into());
    }
    Ok(Box::new(RingVerifier {
        alg: *alg,
        key: key.clone(),
    }))
}

fn signer(alg: &Algorithm, key: &EncodingKey) -> Result<Box<dyn JwtSigner>> {
    (PURE.signer_factory)(alg, key)
}

fn rsa_private(der: &[u8]) -> Result<(Vec<u8>, Vec<u8>)> {
    (PURE.key_utils.rsa_pub_components_from_private_key)(der)
}

fn rsa_public(der: &[u8]) -> Result<(Vec<u8>, Vec<u8>)> {
    (PURE.key_utils.rsa_pub_components_from_public_key)(der)
}

fn ec_private(der: &[u8], alg: Algorithm) -> Result<(EllipticCurve, Vec<u8>, Vec<u8>)> {
    (PURE.key_utils.ec_pub_components_from_private_key)(der, alg)
}

fn ed_private(der: &[u8], curve: &EllipticCurve) -> Result<Vec<u8>> {
    (PURE.key_utils.ed_pub_components_from_private_key)(der, curve)
}

fn digest(data: &[u8], hash: ThumbprintHash) -> Result<Vec<u8>> {
    (PURE.key_utils.compute_digest)(data, hash)
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::jwk::Jwk;
    use jsonwebtoken::Header;

    fn data(name: &str) -> Vec<u8> {
        std::fs::read(format!(
            "{}/tests/data/jwt/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .expect("test key")
    }

    /// Signs with jsonwebtoken's pure-Rust provider and checks that ring agrees, on the
    /// message signed and on one changed by a byte.
    #[test]
    fn ring_verifies_what_the_pure_provider_signs_and_nothing_else() {
        let rsa = data("rsa-a.pem");
        let cases: [(Algorithm, EncodingKey); 9] = [
            (
                Algorithm::RS256,
                EncodingKey::from_rsa_pem(&rsa).expect("rsa"),
            ),
            (
                Algorithm::RS384,
                EncodingKey::from_rsa_pem(&rsa).expect("rsa"),
            ),
            (
                Algorithm::RS512,
                EncodingKey::from_rsa_pem(&rsa).expect("rsa"),
            ),
            (
                Algorithm::PS256,
                EncodingKey::from_rsa_pem(&rsa).expect("rsa"),
            ),
            (
                Algorithm::PS384,
                EncodingKey::from_rsa_pem(&rsa).expect("rsa"),
            ),
            (
                Algorithm::PS512,
                EncodingKey::from_rsa_pem(&rsa).expect("rsa"),
            ),
            (
                Algorithm::ES256,
                EncodingKey::from_ec_pem(&data("ec256.pem")).expect("ec"),
            ),
            (
                Algorithm::ES384,
                EncodingKey::from_ec_pem(&data("ec384.pem")).expect("ec"),
            ),
            (
                Algorithm::EdDSA,
                EncodingKey::from_ed_pem(&data("ed25519.pem")).expect("ed"),
            ),
        ];
        for (alg, key) in cases {
            let jwk = Jwk::from_encoding_key(&key, alg).expect("jwk");
            let public = DecodingKey::from_jwk(&jwk).expect("decoding key");
            let token = jsonwebtoken::encode(&Header::new(alg), &serde_json::json!({"a": 1}), &key)
                .expect("sign");
            let (msg, sig_b64) = token.rsplit_once('.').expect("three parts");
            let signature = {
                use base64::Engine;
                base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(sig_b64)
                    .expect("base64url")
            };
            let v = verifier(&alg, &public).expect("verifier");
            assert!(v.verify(msg.as_bytes(), &signature).is_ok(), "{alg:?}");
            let mut changed = msg.as_bytes().to_vec();
            changed[3] ^= 1;
            assert!(v.verify(&changed, &signature).is_err(), "{alg:?} changed");
            // And not with another algorithm of another kind on the same key.
            let other = if alg.family() == AlgorithmFamily::Rsa {
                Algorithm::ES256
            } else {
                Algorithm::RS256
            };
            assert!(verifier(&other, &public).is_err(), "{alg:?} as {other:?}");
        }
    }
}
