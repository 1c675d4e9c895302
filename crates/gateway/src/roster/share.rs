//! Managed consumers shared among the nodes of a cluster through Redis: a hash holds each
//! consumer's newest record (`{PREFIX:consumers}`), a stream carries each change as it is
//! made (`{PREFIX:consumers}:changes`, trimmed to about 100,000; one hash tag, so a Redis
//! Cluster keeps both in one slot). A node reads the stream
//! every 100 ms; when it connects (at start, and after Redis was away) it reads the whole
//! hash, so a node that was away catches up, and writes back what it changed meanwhile.
//! The newest version of a name wins everywhere; a record is written to the hash only if it
//! is newer than the one there (one script, so two nodes never undo each other).

use super::record::Managed;
use super::Roster;
use crate::redis_link::RedisConn;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tollgate_config::ClusterConfig;

/// How often the stream is read.
const POLL: Duration = Duration::from_millis(100);
/// Longest wait on Redis for one command.
const TIMEOUT: Duration = Duration::from_secs(2);
/// Entries the stream keeps (about): a node away longer catches up from the hash.
const STREAM_LEN: usize = 100_000;
/// Stream entries read at once.
const READ: usize = 1000;

/// Writes a record to the hash if it is newer than the one there, and to the stream.
const PUBLISH: &str = r"
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ok, old = pcall(cjson.decode, cur)
  if ok and type(old) == 'table' and tonumber(old.version) and tonumber(old.version) >= tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'r', ARGV[2])
return 1
";

/// Starts sharing `roster` through the cluster's Redis; the task ends with the roster.
pub fn spawn(roster: &Arc<Roster>, cfg: &ClusterConfig) {
    let (tx, rx) = unbounded_channel();
    *roster.outbox.lock() = Some(tx);
    // One hash tag for both: the script writes them together, so on a Redis Cluster they
    // must share a slot.
    let keys = Keys {
        hash: format!("{{{}:consumers}}", cfg.key_prefix),
        stream: format!("{{{}:consumers}}:changes", cfg.key_prefix),
    };
    let link = (cfg.redis.clone(), cfg.redis_tls.clone());
    tokio::spawn(run(Arc::downgrade(roster), link, keys, rx));
}

struct Keys {
    hash: String,
    stream: String,
}

async fn run(
    roster: Weak<Roster>,
    (url, tls): (
        tollgate_config::RedisTarget,
        Option<Arc<tollgate_config::RedisTls>>,
    ),
    keys: Keys,
    mut outbox: UnboundedReceiver<Managed>,
) {
    let script = redis::Script::new(PUBLISH);
    let mut said: Option<String> = None;
    let mut wait = POLL;
    loop {
        if roster.strong_count() == 0 {
            return;
        }
        let outcome = match crate::redis_link::redis_connection(&url, tls.as_ref(), TIMEOUT).await {
            Ok(mut con) => {
                let (out, said) = (&mut outbox, &mut said);
                session(&roster, &mut con, (&keys, &script), out, said, &mut wait).await
            }
            Err(e) => Err(e),
        };
        match outcome {
            Ok(()) => return,
            Err(e) => {
                let text = e.to_string();
                if said.as_deref() != Some(text.as_str()) {
                    tracing::warn!(
                        "managed consumers: Redis unreachable ({text}); changes apply on this node and are shared when it is back"
                    );
                    said = Some(text);
                }
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(crate::redis_link::max_backoff(&url));
    }
}

/// One connection's life: catch up, then follow the stream and publish local changes.
/// Ends `Ok` when the roster is gone. The wait before the next connection is reset only
/// once caught up: a server that takes connections and fails them (one node of a Redis
/// Cluster, a replica refusing the writes) is tried again with backoff.
async fn session(
    roster: &Weak<Roster>,
    con: &mut RedisConn,
    (keys, script): (&Keys, &redis::Script),
    outbox: &mut UnboundedReceiver<Managed>,
    said: &mut Option<String>,
    wait: &mut Duration,
) -> redis::RedisResult<()> {
    // The stream's end first: what is added while the hash is read is read again after.
    let last: redis::streams::StreamRangeReply = redis::cmd("XREVRANGE")
        .arg(&keys.stream)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(con)
        .await?;
    let mut last_id = last
        .ids
        .first()
        .map_or_else(|| "0-0".to_string(), |e| e.id.clone());
    let mut theirs: HashMap<String, u64> = HashMap::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, pairs): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(&keys.hash)
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(con)
            .await?;
        let mut batch = Vec::with_capacity(pairs.len());
        for (_, json) in pairs {
            if let Ok(m) = serde_json::from_str::<Managed>(&json) {
                theirs.insert(m.name.clone(), m.version);
                batch.push(m);
            }
        }
        if !absorb(roster, batch).await {
            return Ok(());
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    // What this node changed while Redis was away (or before it ever reached it).
    let mine = match roster.upgrade() {
        Some(r) => r.newer_than(&theirs),
        None => return Ok(()),
    };
    for m in mine {
        publish(con, keys, script, &m).await?;
    }
    // Said once caught up, not on connecting: a Redis that accepts and then fails (still
    // loading, read-only) is not "back".
    if said.take().is_some() {
        tracing::info!("managed consumers: Redis is reachable again; sharing changes");
    }
    *wait = POLL;
    let mut tick = tokio::time::interval(POLL);
    loop {
        tokio::select! {
            change = outbox.recv() => match change {
                Some(m) => publish(con, keys, script, &m).await?,
                None => return Ok(()),
            },
            _ = tick.tick() => {
                // Everything added since the last read, a thousand at a time.
                loop {
                    let reply: redis::streams::StreamReadReply = redis::cmd("XREAD")
                        .arg("COUNT")
                        .arg(READ)
                        .arg("STREAMS")
                        .arg(&keys.stream)
                        .arg(&last_id)
                        .query_async(con)
                        .await?;
                    let mut batch = Vec::new();
                    for k in reply.keys {
                        for e in k.ids {
                            if let Some(redis::Value::BulkString(b)) = e.map.get("r") {
                                if let Ok(m) = serde_json::from_slice::<Managed>(b) {
                                    batch.push(m);
                                }
                            }
                            last_id = e.id;
                        }
                    }
                    let full = batch.len() >= READ;
                    if !absorb(roster, batch).await {
                        return Ok(());
                    }
                    if !full {
                        break;
                    }
                }
            }
        }
    }
}

/// Applies records from Redis on a blocking thread (the log is synced). False when the
/// roster is gone.
async fn absorb(roster: &Weak<Roster>, batch: Vec<Managed>) -> bool {
    let Some(r) = roster.upgrade() else {
        return false;
    };
    if batch.is_empty() {
        return true;
    }
    let _ = tokio::task::spawn_blocking(move || r.absorb(batch)).await;
    true
}

async fn publish(
    con: &mut RedisConn,
    keys: &Keys,
    script: &redis::Script,
    m: &Managed,
) -> redis::RedisResult<()> {
    let json = serde_json::to_string(m).unwrap_or_default();
    let _: i64 = script
        .key(&keys.hash)
        .key(&keys.stream)
        .arg(&m.name)
        .arg(json)
        .arg(m.version)
        .arg(STREAM_LEN)
        .invoke_async(con)
        .await?;
    Ok(())
}
