//! A test CA made by the test, certificates it signs, and TLS clients that trust it.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A CA whose files live in `dir`.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pub dir: PathBuf,
    /// The CA certificate's PEM file.
    pub pem: PathBuf,
}

/// A certificate and key the CA signed, as PEM files and DER.
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub der: CertificateDer<'static>,
    pub key_der: PrivateKeyDer<'static>,
}

impl TestCa {
    /// A new CA with its PEM in `dir`.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let issuer =
            CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("CA");
        let pem = dir.join(format!("{name}.pem"));
        std::fs::write(&pem, issuer.pem()).expect("write CA");
        TestCa {
            issuer,
            dir: dir.to_path_buf(),
            pem,
        }
    }

    /// A server certificate for `names` (SAN DNS names or IPs), written as `file.pem` and
    /// `file.key`.
    pub fn server(&self, file: &str, names: &[&str]) -> Leaf {
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(file, params)
    }

    /// A client certificate with subject CN `cn` and no SAN.
    pub fn client(&self, file: &str, cn: &str) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(file, params)
    }

    fn sign(&self, file: &str, params: CertificateParams) -> Leaf {
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        let (c, k) = (
            self.dir.join(format!("{file}.pem")),
            self.dir.join(format!("{file}.key")),
        );
        std::fs::write(&c, cert.pem()).expect("write cert");
        std::fs::write(&k, key.serialize_pem()).expect("write key");
        Leaf {
            cert: c,
            key: k,
            der: cert.der().clone(),
            key_der: PrivateKeyDer::try_from(key.serialize_der()).expect("key der"),
        }
    }

    /// A client config trusting this CA, offering `alpn`, with a client certificate when given.
    pub fn client_config(&self, alpn: &[&[u8]], cert: Option<&Leaf>) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.issuer.der().clone()).expect("add CA");
        let b = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
        let mut cfg = match cert {
            Some(l) => b
                .with_client_auth_cert(vec![l.der.clone()], l.key_der.clone_key())
                .expect("client cert"),
            None => b.with_no_client_auth(),
        };
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(cfg)
    }
}

/// A TLS connection to `addr` naming `sni`.
pub async fn connect(
    addr: SocketAddr,
    sni: &str,
    cfg: Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from(sni.to_string()).expect("server name");
    tokio_rustls::TlsConnector::from(cfg)
        .connect(name, tcp)
        .await
}

/// The SAN DNS names of the certificate the server presented.
pub fn presented_names(s: &TlsStream<TcpStream>) -> Vec<String> {
    let (_, conn) = s.get_ref();
    let Some(cert) = conn.peer_certificates().and_then(|c| c.first()) else {
        return Vec::new();
    };
    let ee = webpki::EndEntityCert::try_from(cert).expect("parse");
    ee.valid_dns_names().map(str::to_string).collect()
}
