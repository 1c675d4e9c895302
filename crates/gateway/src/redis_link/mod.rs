//! How every Redis link of the gateway opens (limits, usage history, managed consumers,
//! `tollgate usage`): to one server by URL, to the master a set of Redis Sentinels names
//! (asked of them at every connection and once a second while it is in use, and heard from
//! as a failover starts: when they name another master or promote a replica, the
//! connection fails its commands and its owner reconnects), or to a Redis Cluster (keys
//! routed by hash slot, MOVED / ASK followed).

mod client;
mod watch;

pub use client::TlsFiles;
use client::{certificates, client};

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};
use std::sync::Arc;
use std::time::Duration;
use tollgate_config::RedisTarget;

/// A connection to the Redis a config names. Cheap to clone (both kinds multiplex).
#[derive(Clone)]
pub enum RedisConn {
    /// One server (by URL, or the master the sentinels named, with what they name now).
    One(MultiplexedConnection, Option<Arc<Followed>>),
    /// A Redis Cluster: every command goes to the master of its key's slot. A pipeline
    /// must keep to one slot ([`RedisConn::is_cluster`] tells callers to group by slot).
    Cluster(ClusterConnection),
}

impl RedisConn {
    /// Whether this is a Redis Cluster, where a pipeline or script keeps to one hash slot.
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster(_))
    }

    /// Whether the sentinels name another master than the one this connection reached:
    /// its commands fail, and its owner should connect again.
    pub fn is_stale(&self) -> bool {
        matches!(self, RedisConn::One(_, Some(f)) if f.is_stale())
    }
}

/// The master a connection reached through the sentinels, and what they say now.
pub struct Followed {
    reached: String,
    watch: Arc<watch::Watch>,
}

impl Followed {
    fn is_stale(&self) -> bool {
        self.watch.is_stale(&self.reached)
    }
}

fn stale<T: Send + 'static>() -> RedisFuture<'static, T> {
    Box::pin(async {
        Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "the sentinels name another master",
        )))
    })
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::One(_, Some(f)) if f.is_stale() => stale(),
            RedisConn::One(c, _) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::One(_, Some(f)) if f.is_stale() => stale(),
            RedisConn::One(c, _) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::One(c, _) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

/// The longest wait between attempts to reconnect to `target`: 5 s to one server; 1 s where
/// a failover is expected to be followed (Sentinel, Redis Cluster), so that a node is on the
/// promoted master about a second after it is named, however long the failover took.
pub fn max_backoff(target: &RedisTarget) -> Duration {
    match target {
        RedisTarget::Url(_) => Duration::from_secs(5),
        RedisTarget::Sentinel { .. } | RedisTarget::Cluster { .. } => Duration::from_secs(1),
    }
}

/// A connection to `target`, giving up on connecting or on an answer after `timeout`.
/// Every Redis link of the gateway opens this way.
pub async fn redis_connection(
    target: &RedisTarget,
    tls: TlsFiles<'_>,
    timeout: Duration,
) -> Result<RedisConn, redis::RedisError> {
    Ok(redis_connection_at(target, tls, timeout).await?.0)
}

/// [`redis_connection`], and the address of the server it reached (`host:port`: with
/// sentinels, the master they named; for a Redis Cluster, the seed nodes).
pub async fn redis_connection_at(
    target: &RedisTarget,
    tls: TlsFiles<'_>,
    timeout: Duration,
) -> Result<(RedisConn, String), redis::RedisError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    match target {
        RedisTarget::Url(url) => {
            let client = client(url.as_str(), tls)?;
            let addr = client.get_connection_info().addr().to_string();
            let conn = connect(&client, timeout).await?;
            Ok((RedisConn::One(conn, None), addr))
        }
        RedisTarget::Sentinel {
            sentinels,
            master_name,
            ..
        } => {
            let urls = sentinel_urls(target, sentinels);
            sentinel_connection(target, urls, master_name, tls, timeout).await
        }
        RedisTarget::Cluster {
            nodes,
            username,
            password,
            tls: on,
        } => {
            let auth = (username.as_deref(), password.as_deref());
            let conn = cluster_connection(nodes, auth, tls.filter(|_| *on), *on, timeout).await?;
            Ok((RedisConn::Cluster(conn), nodes.join(",")))
        }
    }
}

/// A connection to the Redis Cluster of the seed `nodes` (slots learned from them, `MOVED`
/// and `ASK` followed), as the user and password of `auth`, over TLS when `tls`.
async fn cluster_connection(
    nodes: &[String],
    (username, password): (Option<&str>, Option<&str>),
    files: TlsFiles<'_>,
    tls: bool,
    timeout: Duration,
) -> Result<ClusterConnection, redis::RedisError> {
    let scheme = if tls { "rediss" } else { "redis" };
    let urls: Vec<String> = nodes.iter().map(|n| format!("{scheme}://{n}")).collect();
    let mut b = redis::cluster::ClusterClientBuilder::new(urls)
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .retries(2);
    if let Some(u) = username {
        b = b.username(u);
    }
    if let Some(p) = password {
        b = b.password(p);
    }
    if let Some(t) = files {
        b = b.certs(certificates(t));
    }
    let client = b.build()?;
    match tokio::time::timeout(timeout * 2, client.get_async_connection()).await {
        Ok(c) => c,
        Err(_) => Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "no node of the Redis Cluster answered in time",
        ))),
    }
}

/// A connection to the master the sentinels at `urls` name `master_name` (or, while they
/// promote a replica, to that replica once it is a master), followed by the process's
/// watch of what they say.
async fn sentinel_connection(
    target: &RedisTarget,
    urls: Vec<String>,
    master_name: &str,
    tls: TlsFiles<'_>,
    timeout: Duration,
) -> Result<(RedisConn, String), redis::RedisError> {
    let watch = watch::watch(urls.clone(), master_name, tls.cloned());
    let asked = std::time::Instant::now();
    // During a failover the sentinels still name the old master: go to the replica they
    // are promoting instead, once it says it is a master.
    let promoting = watch.promoting();
    let addr = match &promoting {
        Some(to) => to.clone(),
        None => {
            let named = tokio::time::timeout(
                timeout,
                watch::named_master(&urls, master_name, tls, &mut None),
            )
            .await;
            match named {
                Ok(Some(addr)) => addr,
                _ => {
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "no sentinel named the master in time",
                    )))
                }
            }
        }
    };
    let mut conn = connect(&client_at(target, &addr, tls)?, timeout).await?;
    // As the sentinels' clients are asked to: the server named must say it is a master
    // (one they name before it has been promoted, or after it was demoted, is not yet).
    if !is_master(&mut conn).await? {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "the server the sentinels name or promote is not a master (yet)",
            addr,
        )));
    }
    if promoting.is_none() {
        watch.named(addr.clone(), asked);
    }
    let followed = Followed {
        reached: addr.clone(),
        watch,
    };
    // A switch heard while connecting: this one is already out of date.
    if followed.is_stale() {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "the sentinels named another master while connecting",
            addr,
        )));
    }
    Ok((RedisConn::One(conn, Some(Arc::new(followed))), addr))
}

/// A multiplexed connection of `client`, giving up on connecting or on an answer after
/// `timeout`.
async fn connect(
    client: &redis::Client,
    timeout: Duration,
) -> redis::RedisResult<MultiplexedConnection> {
    let cfg = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await
}

/// Whether the server a connection reached says it is a master (`ROLE`).
async fn is_master(conn: &mut MultiplexedConnection) -> redis::RedisResult<bool> {
    let role: Vec<Value> = redis::cmd("ROLE").query_async(conn).await?;
    Ok(match role.first() {
        Some(Value::BulkString(b)) => b.as_slice() == b"master",
        Some(Value::SimpleString(s)) => s == "master",
        _ => false,
    })
}

/// Each sentinel as a URL, with the sentinels' own credentials when they ask for them.
fn sentinel_urls(target: &RedisTarget, sentinels: &[String]) -> Vec<String> {
    let auth = match target {
        RedisTarget::Sentinel {
            sentinel_username,
            sentinel_password: Some(pw),
            ..
        } => format!(
            "{}:{}@",
            tollgate_config::percent_encode(sentinel_username.as_deref().unwrap_or("")),
            tollgate_config::percent_encode(pw)
        ),
        _ => String::new(),
    };
    let scheme = match target {
        RedisTarget::Sentinel { tls: true, .. } => "rediss",
        _ => "redis",
    };
    sentinels
        .iter()
        .map(|s| format!("{scheme}://{auth}{s}"))
        .collect()
}

/// The client of the server at `address` (`host:port`, as the sentinels name servers),
/// with the credentials and database the target gives its master.
fn client_at(
    target: &RedisTarget,
    address: &str,
    tls: TlsFiles<'_>,
) -> redis::RedisResult<redis::Client> {
    let bad = || {
        redis::RedisError::from((
            redis::ErrorKind::Client,
            "the sentinels named a server that is not host:port",
            address.to_string(),
        ))
    };
    let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let addr = match target {
        RedisTarget::Sentinel { tls: true, .. } => redis::ConnectionAddr::TcpTls {
            host: host.to_string(),
            port,
            insecure: false,
            tls_params: None,
        },
        _ => redis::ConnectionAddr::Tcp(host.to_string(), port),
    };
    let info = redis::IntoConnectionInfo::into_connection_info(addr)?
        .set_redis_settings(node_info(target));
    client(info, tls)
}

/// The credentials and database of a master the sentinels name.
fn node_info(target: &RedisTarget) -> redis::RedisConnectionInfo {
    let mut info = redis::RedisConnectionInfo::default();
    if let RedisTarget::Sentinel {
        username,
        password,
        db,
        ..
    } = target
    {
        info = info.set_db(*db);
        if let Some(u) = username {
            info = info.set_username(u);
        }
        if let Some(p) = password {
            info = info.set_password(p);
        }
    }
    info
}

/// The hash slot of `key` (of its `{tag}` if it has one): the commands of one pipeline or
/// script on a Redis Cluster must keep to one.
pub fn slot_of(key: &str) -> redis::cluster_routing::Slot {
    redis::cluster_routing::Slot::for_key(key)
}

/// One hash slot's part of [`query_by_slot`]: where its commands stood in the call, and
/// their answers (or why the slot's master did not give them).
pub type SlotAnswers = (Vec<usize>, redis::RedisResult<Vec<Value>>);

/// Runs `cmds`, each on the key it names, and yields the answers as they come: one
/// pipeline on one server; on a Redis Cluster, one pipeline per hash slot, all at once, so
/// that a master that is dead or slow fails or delays its own slots' part alone. A part
/// not answered within `deadline` (if given) fails with a timeout, whatever the client
/// still tries for it (the Redis Cluster client retries a dead master until a replica takes
/// its slots over, which takes seconds).
pub fn query_by_slot(
    conn: &RedisConn,
    cmds: Vec<(String, Cmd)>,
    deadline: Option<Duration>,
) -> FuturesUnordered<BoxFuture<'static, SlotAnswers>> {
    let mut groups: Vec<(Pipeline, Vec<usize>)> = Vec::new();
    match conn {
        RedisConn::One(..) => {
            let mut pipe = redis::pipe();
            let mut at = Vec::with_capacity(cmds.len());
            for (i, (_, cmd)) in cmds.into_iter().enumerate() {
                pipe.add_command(cmd);
                at.push(i);
            }
            groups.push((pipe, at));
        }
        RedisConn::Cluster(_) => {
            let mut by_slot: std::collections::HashMap<_, (Pipeline, Vec<usize>)> =
                std::collections::HashMap::new();
            for (i, (key, cmd)) in cmds.into_iter().enumerate() {
                let g = by_slot.entry(slot_of(&key)).or_default();
                g.0.add_command(cmd);
                g.1.push(i);
            }
            groups.extend(by_slot.into_values());
        }
    }
    groups
        .into_iter()
        .filter(|(_, at)| !at.is_empty())
        .map(|(pipe, at)| {
            let mut c = conn.clone();
            let asked: BoxFuture<'static, SlotAnswers> = Box::pin(async move {
                let query = pipe.query_async(&mut c);
                let answers = match deadline {
                    Some(d) => tokio::time::timeout(d, query).await.unwrap_or_else(|_| {
                        Err(redis::RedisError::from((
                            redis::ErrorKind::Io,
                            "no answer in time from the master of these keys",
                        )))
                    }),
                    None => query.await,
                };
                (at, answers)
            });
            asked
        })
        .collect()
}

/// Runs `cmds`, each on the key it names, and returns their answers in order; fails if any
/// part fails ([`query_by_slot`] gives each part on its own).
pub async fn query_keyed(
    conn: &RedisConn,
    cmds: Vec<(String, Cmd)>,
) -> redis::RedisResult<Vec<Value>> {
    let mut out = vec![Value::Nil; cmds.len()];
    let mut parts = query_by_slot(conn, cmds, None);
    while let Some((at, answers)) = parts.next().await {
        for (i, v) in at.into_iter().zip(answers?) {
            out[i] = v;
        }
    }
    Ok(out)
}
