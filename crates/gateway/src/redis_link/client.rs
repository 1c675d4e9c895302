//! A Redis client for a URL or an address, over TLS with the CA and the client
//! certificate the config names (`cluster.redis.tls`), shared by every way a link opens.

use std::sync::Arc;
use tollgate_config::RedisTls;

/// What TLS to Redis trusts and presents, when the config names files for it.
pub type TlsFiles<'a> = Option<&'a Arc<RedisTls>>;

/// A client of the server `info` names: over TLS with `tls`'s CA and client certificate
/// when it gives them (the URL or address says whether TLS is spoken at all).
pub(super) fn client(
    info: impl redis::IntoConnectionInfo,
    tls: TlsFiles<'_>,
) -> redis::RedisResult<redis::Client> {
    let info = info.into_connection_info()?;
    match tls {
        Some(t) if matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) => {
            redis::Client::build_with_tls(info, certificates(t))
        }
        _ => redis::Client::open(info),
    }
}

/// The CA and the client certificate of `t`, as the Redis client takes them.
pub(super) fn certificates(t: &RedisTls) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: t.client.as_ref().map(|(cert, key)| redis::ClientTlsConfig {
            client_cert: cert.clone(),
            client_key: key.clone(),
        }),
        root_cert: t.ca_pem.clone(),
    }
}
