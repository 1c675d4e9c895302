//! TLS material named by the config: certificate chains with their keys (checked to match)
//! and CA bundles, read and parsed at validation so that a bad file is a config error with
//! its place, and a reload picks up renewed files.

use rustls::crypto::ring::default_provider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A listener's TLS settings and the material they name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// Chains and keys, in file order; the first is served when no SAN matches.
    pub certificates: Vec<LoadedCert>,
    /// Roots client certificates are verified against, when mTLS is on.
    pub client_ca: Option<CaBundle>,
    /// A client without a certificate is refused at the handshake.
    pub client_auth_required: bool,
    /// Accept TLS 1.2 (else 1.3 only).
    pub tls12: bool,
}

/// One certificate chain and its private key.
#[derive(Debug, Clone)]
pub struct LoadedCert {
    /// The chain's file.
    pub cert_path: PathBuf,
    /// The key's file.
    pub key_path: PathBuf,
    /// DNS names of the leaf's SAN (`api.example.com`, `*.example.com`), lowercase.
    pub names: Vec<String>,
    /// Chain and signing key, ready for rustls.
    pub key: Arc<CertifiedKey>,
    /// Fingerprint of both files' content.
    pub fingerprint: u64,
}

impl PartialEq for LoadedCert {
    fn eq(&self, other: &Self) -> bool {
        self.cert_path == other.cert_path
            && self.key_path == other.key_path
            && self.fingerprint == other.fingerprint
    }
}

impl Eq for LoadedCert {}

/// CA certificates from a PEM bundle.
#[derive(Debug, Clone)]
pub struct CaBundle {
    /// The bundle's file.
    pub path: PathBuf,
    /// Its certificates, DER.
    pub certs: Vec<CertificateDer<'static>>,
    /// Fingerprint of the file's content.
    pub fingerprint: u64,
}

impl PartialEq for CaBundle {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path && self.fingerprint == other.fingerprint
    }
}

impl Eq for CaBundle {}

impl std::hash::Hash for CaBundle {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.path.hash(state);
        self.fingerprint.hash(state);
    }
}

/// The files of TLS to Redis, read at load: a CA bundle to trust instead of the system's
/// roots, and a client certificate with its key (Redis's `tls-auth-clients`).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RedisTls {
    /// The CA bundle's PEM.
    pub ca_pem: Option<Vec<u8>>,
    /// The client certificate's PEM and its key's.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTls")
            .field("ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

/// A PEM reading error in words a user can act on (the library's names the end marker as
/// a list of bytes).
fn pem_words(e: &rustls::pki_types::pem::Error, key: bool) -> String {
    use rustls::pki_types::pem::Error;
    match e {
        Error::MissingSectionEnd { end_marker } => format!(
            "a PEM section is not closed (no line `-----END {}-----`): is the file cut short?",
            String::from_utf8_lossy(end_marker)
        ),
        Error::IllegalSectionStart { line } => format!(
            "a line that begins a PEM section cannot be read: `{}`",
            String::from_utf8_lossy(line)
        ),
        Error::Base64Decode(_) if key => "a PEM section is not base64 (an encrypted key in the traditional format, with `Proc-Type: 4,ENCRYPTED`? the gateway reads unencrypted keys only: `openssl pkey -in KEY -out KEY.plain`)".to_string(),
        Error::Base64Decode(e) => format!("a PEM section is not base64 ({e})"),
        Error::NoItemsFound if key => "no unencrypted private key (PKCS#8, PKCS#1 or SEC1) in the file (an `ENCRYPTED PRIVATE KEY` cannot be read: `openssl pkey -in KEY -out KEY.plain`)".to_string(),
        e => e.to_string(),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Reads a chain and its key, and checks that the key is the leaf's.
pub fn load_cert(cert_path: PathBuf, key_path: PathBuf) -> Result<LoadedCert, String> {
    let cert_pem = read(&cert_path)?;
    let key_pem = read(&key_path)?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            format!(
                "{}: not a PEM certificate chain: {}",
                cert_path.display(),
                pem_words(&e, false)
            )
        })?;
    let Some(leaf) = chain.first() else {
        return Err(format!(
            "{}: no certificate in the file (expected -----BEGIN CERTIFICATE-----)",
            cert_path.display()
        ));
    };
    let names = webpki::EndEntityCert::try_from(leaf)
        .map_err(|e| {
            // OpenSSL's `x509 -req` without extensions makes a version 1 certificate,
            // which rustls does not take.
            let hint = if matches!(e, webpki::Error::UnsupportedCertVersion) {
                " (an X.509 version 1 certificate: TLS here takes version 3; issue it with extensions, e.g. `openssl x509 -req … -extfile <(printf 'basicConstraints=CA:FALSE')`)"
            } else {
                ""
            };
            format!(
                "{}: the first certificate cannot be parsed: {e}{hint}",
                cert_path.display()
            )
        })?
        .valid_dns_names()
        .map(str::to_ascii_lowercase)
        .collect();
    let key = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| format!("{}: {}", key_path.display(), pem_words(&e, true)))?;
    let key = CertifiedKey::from_der(chain, key, &default_provider()).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => format!(
            "the private key in {} is not the key of the certificate in {} (check that the two files are a pair)",
            key_path.display(),
            cert_path.display()
        ),
        e => format!(
            "the key in {} cannot be used with the certificate in {} (too small, or of a kind rustls does not take: RSA of 2048 bits or more, ECDSA P-256 or P-384, Ed25519): {e}",
            key_path.display(),
            cert_path.display()
        ),
    })?;
    let mut both = cert_pem;
    both.extend_from_slice(&key_pem);
    Ok(LoadedCert {
        cert_path,
        key_path,
        names,
        key: Arc::new(key),
        fingerprint: crate::fingerprint(&both),
    })
}

/// Reads a PEM bundle of CA certificates (at least one).
pub fn load_ca(path: PathBuf) -> Result<CaBundle, String> {
    let pem = read(&path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not a PEM certificate bundle: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in the file", path.display()));
    }
    let mut roots = rustls::RootCertStore::empty();
    let (_, bad) = roots.add_parsable_certificates(certs.iter().cloned());
    if bad > 0 {
        return Err(format!(
            "{}: {bad} certificate(s) cannot be used as a trust anchor",
            path.display()
        ));
    }
    Ok(CaBundle {
        path,
        certs,
        fingerprint: crate::fingerprint(&pem),
    })
}

/// What the files hold now, read one after the other, as one fingerprint (0 when one
/// cannot be read): a chain and its key, or a CA bundle, as they were fingerprinted at load.
fn on_disk(paths: &[&Path]) -> u64 {
    let mut all = Vec::new();
    for p in paths {
        match std::fs::read(p) {
            Ok(b) => all.extend_from_slice(&b),
            Err(_) => return 0,
        }
    }
    crate::fingerprint(&all)
}

/// Every group of key files the config names (a chain and its key, a client CA, an upstream
/// CA, a route's `jwks_file` or `secret_file`) with the fingerprint its content was loaded
/// with. Renewed certificates and rotated token keys reload the config even when its own
/// text did not change.
fn groups(cfg: &crate::Config) -> Vec<(u64, Vec<&Path>)> {
    let mut out = Vec::new();
    for l in &cfg.listeners {
        if let Some(t) = &l.tls {
            for c in &t.certificates {
                out.push((
                    c.fingerprint,
                    vec![c.cert_path.as_path(), c.key_path.as_path()],
                ));
            }
            if let Some(ca) = &t.client_ca {
                out.push((ca.fingerprint, vec![ca.path.as_path()]));
            }
        }
    }
    for u in &cfg.upstreams {
        if let Some(ca) = &u.ca {
            out.push((ca.fingerprint, vec![ca.path.as_path()]));
        }
    }
    // Token keys read from disk, by the same rule: a rotated secret or key set reloads.
    for r in &cfg.routes {
        let jwt = r.auth.as_ref().and_then(|a| a.jwt.as_ref());
        if let Some((path, loaded)) = jwt.and_then(|j| j.key_file.as_ref()) {
            out.push((*loaded, vec![path.as_path()]));
        }
    }
    out
}

/// Every TLS file (and token key file) the config names, for a watcher to look at their
/// metadata.
pub fn paths(cfg: &crate::Config) -> Vec<&Path> {
    groups(cfg).into_iter().flat_map(|(_, p)| p).collect()
}

/// A fingerprint of what the config's TLS files (and token key files) hold now, and whether that differs from
/// what the config was loaded with; `None` when it names no TLS file.
pub fn files_on_disk(cfg: &crate::Config) -> Option<(u64, bool)> {
    let files: Vec<(u64, u64)> = groups(cfg)
        .iter()
        .map(|(loaded, paths)| (*loaded, on_disk(paths)))
        .collect();
    if files.is_empty() {
        return None;
    }
    let changed = files.iter().any(|(loaded, now)| loaded != now);
    let mut all = Vec::with_capacity(files.len() * 8);
    for (_, now) in &files {
        all.extend_from_slice(&now.to_le_bytes());
    }
    Some((crate::fingerprint(&all), changed))
}

#[cfg(test)]
mod tests {
    use super::load_cert;

    #[test]
    fn pem_errors_are_said_in_words() {
        let dir = std::env::temp_dir().join(format!("tollgate-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (cert, key) = (dir.join("cut.pem"), dir.join("enc.key"));
        std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nMIIB\n").expect("write");
        std::fs::write(
            &key,
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n",
        )
        .expect("write");
        let e = load_cert(cert, key.clone()).err().unwrap_or_default();
        assert!(
            e.contains("no line `-----END CERTIFICATE-----`") && e.contains("cut short"),
            "{e}"
        );
        let good = dir.join("empty.pem");
        std::fs::write(&good, "").expect("write");
        let e = load_cert(good, key).err().unwrap_or_default();
        assert!(e.contains("no certificate in the file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
