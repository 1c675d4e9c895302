//! TLS for listeners: a rustls server config per listener (built with each snapshot, so
//! renewed certificates apply to new connections at a reload), the certificate chosen by
//! SNI, and the names a verified client certificate carries for `auth: {mtls: true}`.

use rustls::crypto::ring::default_provider;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig};
use std::collections::HashMap;
use std::sync::Arc;
use tollgate_config::tls::TlsConfig;

/// Picks a certificate by the SNI name: an exact SAN first, then a wildcard SAN
/// (`*.example.com` serves `api.example.com`, not `example.com` nor `a.b.example.com`),
/// then the first certificate listed.
#[derive(Debug)]
struct SniResolver {
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// By the part after `*.`.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    default: Option<Arc<CertifiedKey>>,
}

impl SniResolver {
    fn new(t: &TlsConfig) -> Self {
        let mut exact = HashMap::new();
        let mut wildcard = HashMap::new();
        for c in &t.certificates {
            for n in &c.names {
                match n.strip_prefix("*.") {
                    Some(rest) => wildcard.entry(rest.to_string()),
                    None => exact.entry(n.clone()),
                }
                .or_insert_with(|| c.key.clone());
            }
        }
        SniResolver {
            exact,
            wildcard,
            default: t.certificates.first().map(|c| c.key.clone()),
        }
    }

    fn pick(&self, name: Option<&str>) -> Option<Arc<CertifiedKey>> {
        let Some(name) = name.map(|n| n.trim_end_matches('.').to_ascii_lowercase()) else {
            return self.default.clone();
        };
        if let Some(k) = self.exact.get(&name) {
            return Some(k.clone());
        }
        if let Some((_, parent)) = name.split_once('.') {
            if let Some(k) = self.wildcard.get(parent) {
                return Some(k.clone());
            }
        }
        self.default.clone()
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.pick(hello.server_name())
    }
}

/// The rustls config for a listener's TLS settings: TLS 1.3 (and 1.2 unless turned off),
/// ALPN `h2` then `http/1.1`, client certificates verified against `client_ca` when set.
pub fn server_config(t: &TlsConfig) -> Result<Arc<ServerConfig>, rustls::Error> {
    let provider = Arc::new(default_provider());
    let versions: &[&rustls::SupportedProtocolVersion] = if t.tls12 {
        &[&rustls::version::TLS13, &rustls::version::TLS12]
    } else {
        &[&rustls::version::TLS13]
    };
    let builder =
        ServerConfig::builder_with_provider(provider.clone()).with_protocol_versions(versions)?;
    let builder = match &t.client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            roots.add_parsable_certificates(ca.certs.iter().cloned());
            let v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let v = if t.client_auth_required {
                v
            } else {
                v.allow_unauthenticated()
            };
            builder.with_client_cert_verifier(
                v.build()
                    .map_err(|e| rustls::Error::General(e.to_string()))?,
            )
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_cert_resolver(Arc::new(SniResolver::new(t)));
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The names a verified client certificate carries, in the order they are tried as
/// consumer names: SAN DNS names, URIs and emails, then the subject's CNs.
pub fn client_names(cert: &[u8]) -> Box<[Box<str>]> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert) else {
        return Box::new([]);
    };
    let mut out: Vec<Box<str>> = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(s) | GeneralName::URI(s) | GeneralName::RFC822Name(s) => {
                    out.push(Box::from(*s));
                }
                _ => {}
            }
        }
    }
    for cn in cert.subject().iter_common_name() {
        if let Ok(s) = cn.as_str() {
            out.push(Box::from(s));
        }
    }
    out.into_boxed_slice()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_config::tls::LoadedCert;

    fn cert(names: &[&str]) -> LoadedCert {
        let ck = rcgen::generate_simple_self_signed(
            names.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .expect("generate");
        let dir = std::env::temp_dir().join(format!("tollgate-sni-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).expect("dir");
        let (c, k) = (dir.join("c.pem"), dir.join("k.pem"));
        std::fs::write(&c, ck.cert.pem()).expect("write");
        std::fs::write(&k, ck.signing_key.serialize_pem()).expect("write");
        let loaded = tollgate_config::tls::load_cert(c, k).expect("load");
        let _ = std::fs::remove_dir_all(dir);
        loaded
    }

    #[test]
    fn sni_prefers_exact_then_wildcard_then_default() {
        let t = TlsConfig {
            certificates: vec![
                cert(&["default.test"]),
                cert(&["*.example.test"]),
                cert(&["api.example.test"]),
            ],
            client_ca: None,
            client_auth_required: false,
            tls12: true,
        };
        let r = SniResolver::new(&t);
        let key_of = |i: usize| t.certificates[i].key.clone();
        let same = |a: Option<Arc<CertifiedKey>>, b: Arc<CertifiedKey>| {
            a.is_some_and(|a| Arc::ptr_eq(&a, &b))
        };
        assert!(same(r.pick(Some("api.example.test")), key_of(2)));
        assert!(same(r.pick(Some("API.Example.test.")), key_of(2)));
        assert!(same(r.pick(Some("www.example.test")), key_of(1)));
        assert!(same(r.pick(Some("a.b.example.test")), key_of(0)));
        assert!(same(r.pick(Some("example.test")), key_of(0)));
        assert!(same(r.pick(None), key_of(0)));
    }
}
