//! How every Redis link of the gateway opens (limits, usage history, managed consumers,
//! `tollgate usage`): to one server by URL, or to the master a set of Redis Sentinels
//! names, asked of them at every connection so that a failover is followed by the next
//! reconnect.

use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use std::time::Duration;
use tollgate_config::RedisTarget;

/// A connection to `target`, giving up on connecting or on an answer after `timeout`.
/// Every Redis link of the gateway opens this way.
pub async fn redis_connection(
    target: &RedisTarget,
    timeout: Duration,
) -> Result<redis::aio::MultiplexedConnection, redis::RedisError> {
    Ok(redis_connection_at(target, timeout).await?.0)
}

/// [`redis_connection`], and the address of the server it reached (`host:port`: with
/// sentinels, the master they named).
pub async fn redis_connection_at(
    target: &RedisTarget,
    timeout: Duration,
) -> Result<(redis::aio::MultiplexedConnection, String), redis::RedisError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = client(target, timeout).await?;
    let addr = client.get_connection_info().addr().to_string();
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    let conn = client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await?;
    Ok((conn, addr))
}

/// The client of the server to use now: the URL's, or the master the sentinels name.
async fn client(target: &RedisTarget, timeout: Duration) -> redis::RedisResult<redis::Client> {
    match target {
        RedisTarget::Url(url) => redis::Client::open(url.as_str()),
        RedisTarget::Sentinel {
            sentinels,
            master_name,
            password,
            db,
        } => {
            let mut info = redis::RedisConnectionInfo::default().set_db(*db);
            if let Some(p) = password {
                info = info.set_password(p);
            }
            let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
            let urls: Vec<String> = sentinels.iter().map(|s| format!("redis://{s}")).collect();
            let mut sc = SentinelClient::build(
                urls,
                master_name.clone(),
                Some(node),
                SentinelServerType::Master,
            )?;
            match tokio::time::timeout(timeout, sc.async_get_client()).await {
                Ok(c) => c,
                Err(_) => Err(redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "no sentinel named the master in time",
                ))),
            }
        }
    }
}

/// `redis://:secret@host` → `redis://MARK@host`: a Redis URL without its credentials, for
/// the admin API.
pub fn redacted(url: &str, mark: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}{mark}{}", &url[..s + 3], &url[at..]),
        _ => url.to_string(),
    }
}
