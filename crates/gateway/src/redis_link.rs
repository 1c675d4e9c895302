//! How every Redis link of the gateway opens (limits, usage history, `tollgate usage`), and
//! how a Redis URL is shown without its password.

use std::time::Duration;

/// A connection to the Redis at `url` (`rediss://` for TLS), giving up on connecting or on
/// an answer after `timeout`. Every Redis link of the gateway opens this way.
pub async fn redis_connection(
    url: &str,
    timeout: Duration,
) -> Result<redis::aio::MultiplexedConnection, redis::RedisError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = redis::Client::open(url)?;
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
}

/// `redis://:secret@host` → `redis://MARK@host`: a Redis URL without its credentials, for
/// logs and the admin API.
pub fn redacted(url: &str, mark: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}{mark}{}", &url[..s + 3], &url[at..]),
        _ => url.to_string(),
    }
}
