//! What the sentinels say of one master, shared by every connection of this process that
//! reached it through them: the master they name (asked once a second), and a failover
//! under way, heard from their events as it starts. A planned failover (`SENTINEL
//! FAILOVER`) promotes the replica about a second before the sentinels name it, while the
//! old master still takes writes; what it takes then is lost when it is demoted. The
//! leading sentinel announces the replica it chose (`+selected-slave`) about 100 ms before
//! it promotes it, so connections leave the old master then and go to the replica once it
//! says it is a master.

use futures_util::StreamExt;
use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};
use tollgate_config::RedisTls;

/// How often the sentinels are asked which master they name: what a missed event costs.
pub(super) const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// How long a failover heard of stands without the sentinels announcing its end
/// (`+switch-master`) or its abort: past it, the master they name is used again.
const FAILOVER_MOST: Duration = Duration::from_secs(10);

/// The sentinels' events that tell a failover's steps. The first three name the replica
/// being promoted (only the sentinel leading the failover publishes them), the fourth the
/// new master (every sentinel publishes it), the rest an abort.
const EVENTS: [&str; 7] = [
    "+selected-slave",
    "+failover-state-send-slaveof-noone",
    "+promoted-slave",
    "+switch-master",
    "-failover-abort-not-elected",
    "-failover-abort-slave-timeout",
    "-failover-abort-no-good-slave",
];

/// What the sentinels say of one master, kept up to date by this process's tasks for as
/// long as a connection holds it.
pub(super) struct Watch {
    master_name: String,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The master the sentinels name (`host:port`), once one of them has said.
    named: Option<String>,
    /// The last `+switch-master` heard: the master it left, and when. An answer asked before
    /// it, or naming the master it left within [`FAILOVER_MOST`] of it, is out of date (a
    /// sentinel that has not switched yet still names the old master).
    switched: Option<(String, Instant)>,
    /// A failover under way: the replica being promoted, and when it was heard of.
    failover: Option<(String, Instant)>,
    /// When the task asking the sentinels last ran: a watch whose tasks ended with their
    /// runtime is not handed out again.
    ticked: Option<Instant>,
}

impl State {
    fn promoting(&self) -> Option<&str> {
        match &self.failover {
            Some((to, since)) if since.elapsed() < FAILOVER_MOST => Some(to),
            _ => None,
        }
    }
}

impl Watch {
    /// The replica the sentinels are promoting, while a failover is under way: where a new
    /// connection goes (once it says it is a master) instead of the master they still name.
    pub(super) fn promoting(&self) -> Option<String> {
        self.state.lock().promoting().map(str::to_string)
    }

    /// Whether a connection that reached `reached` should leave it: a failover to another
    /// server is under way, or the sentinels name another master.
    pub(super) fn is_stale(&self, reached: &str) -> bool {
        let s = self.state.lock();
        match s.promoting() {
            Some(to) => to != reached,
            None => s.named.as_deref().is_some_and(|n| n != reached),
        }
    }

    /// The master a sentinel named, asked at `asked` (at a connection or once a second);
    /// ignored when a switch heard since, or one that left it, makes it out of date.
    pub(super) fn named(&self, named: String, asked: Instant) {
        let mut s = self.state.lock();
        if let Some((left, at)) = &s.switched {
            if *at > asked || (*left == named && at.elapsed() < FAILOVER_MOST) {
                return;
            }
        }
        if s.named.as_ref().is_some_and(|n| *n != named) {
            tracing::debug!(
                "Redis: the sentinels name {named} as master {:?} now; moving to it",
                self.master_name
            );
        }
        s.named = Some(named);
    }

    /// An event a sentinel published on `channel`; those of other masters are ignored.
    fn event(&self, channel: &str, payload: &str) {
        let words: Vec<&str> = payload.split(' ').collect();
        let mut s = self.state.lock();
        match (channel, words.as_slice()) {
            // `<master> <old ip> <old port> <new ip> <new port>`
            ("+switch-master", [name, old_ip, old_port, ip, port]) if *name == self.master_name => {
                s.named = Some(format!("{ip}:{port}"));
                s.switched = Some((format!("{old_ip}:{old_port}"), Instant::now()));
                s.failover = None;
            }
            // `master <master> <ip> <port>`
            (abort, ["master", name, ..])
                if abort.starts_with("-failover-abort") && *name == self.master_name =>
            {
                tracing::info!(
                    "Redis: the sentinels gave up a failover of master {name:?} ({abort})"
                );
                s.failover = None;
            }
            // `slave <id> <ip> <port> @ <master> <master ip> <master port>`
            (_, ["slave", _, ip, port, "@", name, ..])
                if channel.starts_with('+')
                    && channel != "+switch-master"
                    && *name == self.master_name =>
            {
                let to = format!("{ip}:{port}");
                if s.promoting() != Some(to.as_str()) {
                    tracing::info!(
                        "Redis: the sentinels are promoting {to} to master {name:?} ({channel}); leaving the old master"
                    );
                }
                s.failover = Some((to, Instant::now()));
            }
            _ => {}
        }
    }

    /// Whether its tasks still run: the task asking the sentinels marks each round as it
    /// starts, and a round is at most [`FOLLOW_EVERY`] apart plus its bounded wait.
    fn alive(&self) -> bool {
        self.state
            .lock()
            .ticked
            .is_some_and(|t| t.elapsed() < FOLLOW_EVERY * 5)
    }
}

/// The watches of this process, by sentinel URLs and master name. The map holds each one
/// as well as its connections do: between a connection dropped and the next one made (a
/// failover is when that happens), what the watch heard must not be forgotten.
type Watches = Mutex<HashMap<Key, Arc<Watch>>>;

/// The sentinels' URLs, the master's name, and the files of TLS to them.
type Key = (Vec<String>, String, Option<Arc<RedisTls>>);

static WATCHES: OnceLock<Watches> = OnceLock::new();

/// How long a watch no connection holds is kept before its tasks end.
const UNUSED_MOST: Duration = Duration::from_secs(60);

/// The watch of `master_name` through `sentinels` (URLs), shared by every connection of
/// this process to it: made, with its tasks, by the first one.
pub(super) fn watch(
    sentinels: Vec<String>,
    master_name: &str,
    tls: Option<Arc<RedisTls>>,
) -> Arc<Watch> {
    let mut all = WATCHES.get_or_init(Watches::default).lock();
    let key = (sentinels, master_name.to_string(), tls);
    if let Some(w) = all.get(&key).filter(|w| w.alive()) {
        return w.clone();
    }
    let w = Arc::new(Watch {
        master_name: key.1.clone(),
        state: Mutex::new(State {
            ticked: Some(Instant::now()),
            ..State::default()
        }),
    });
    tokio::spawn(ask(key.clone(), Arc::downgrade(&w)));
    for url in &key.0 {
        tokio::spawn(listen(url.clone(), key.2.clone(), Arc::downgrade(&w)));
    }
    all.insert(key, w.clone());
    w
}

/// Asks the sentinels once a second which master they name, for as long as the watch is
/// kept; it is dropped (and its tasks end) once no connection has held it for
/// [`UNUSED_MOST`].
async fn ask(key: Key, weak: Weak<Watch>) {
    let mut tick = tokio::time::interval(FOLLOW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut asking: Option<(usize, MultiplexedConnection)> = None;
    let mut unused_since: Option<Instant> = None;
    loop {
        tick.tick().await;
        let asked = Instant::now();
        match weak.upgrade() {
            Some(w) => w.state.lock().ticked = Some(asked),
            None => return,
        }
        // Bounded: sentinels that do not answer make a round no longer than this.
        let named = tokio::time::timeout(
            FOLLOW_EVERY * 2,
            named_master(&key.0, &key.1, key.2.as_ref(), &mut asking),
        )
        .await
        .ok()
        .flatten();
        let Some(w) = weak.upgrade() else { return };
        if let Some(named) = named {
            w.named(named, asked);
        }
        let mut all = WATCHES.get_or_init(Watches::default).lock();
        // Held here and by the map only (new holders take it under the map's lock).
        if Arc::strong_count(&w) == 2 {
            if unused_since.get_or_insert_with(Instant::now).elapsed() >= UNUSED_MOST {
                if all.get(&key).is_some_and(|kept| Arc::ptr_eq(kept, &w)) {
                    all.remove(&key);
                }
                return;
            }
        } else {
            unused_since = None;
        }
    }
}

/// Listens to one sentinel's failover events for as long as the watch is held,
/// reconnecting with backoff (from 100 ms to [`FOLLOW_EVERY`]) when it fails.
async fn listen(url: String, tls: Option<Arc<RedisTls>>, weak: Weak<Watch>) {
    let mut backoff = Duration::from_millis(100);
    let mut warned = false;
    while weak.strong_count() > 0 {
        if let Ok(Ok(mut pubsub)) = tokio::time::timeout(FOLLOW_EVERY, async {
            super::client::client(url.as_str(), tls.as_ref())?
                .get_async_pubsub()
                .await
        })
        .await
        {
            let subscribed = pubsub.subscribe(&EVENTS[..]).await;
            if let (Err(e), false) = (&subscribed, warned) {
                // An ACL user without the channels (`&*`) is refused for good.
                tracing::warn!(
                    "Redis: cannot hear a sentinel's failover events ({e}); it is asked once a second instead"
                );
                warned = true;
            }
            if subscribed.is_ok() {
                backoff = Duration::from_millis(100);
                let mut messages = pubsub.on_message();
                loop {
                    match tokio::time::timeout(FOLLOW_EVERY, messages.next()).await {
                        Ok(Some(m)) => {
                            let Some(w) = weak.upgrade() else { return };
                            if let Ok(payload) = m.get_payload::<String>() {
                                w.event(m.get_channel_name(), &payload);
                            }
                        }
                        Ok(None) => break,
                        Err(_) if weak.strong_count() == 0 => return,
                        Err(_) => {}
                    }
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(FOLLOW_EVERY);
    }
}

/// The master the first sentinel to answer names (`host:port`), asked on the connection
/// kept from the last time; `None` when none of them answers.
pub(super) async fn named_master(
    sentinels: &[String],
    master_name: &str,
    tls: super::client::TlsFiles<'_>,
    asking: &mut Option<(usize, MultiplexedConnection)>,
) -> Option<String> {
    let start = asking.as_ref().map_or(0, |(i, _)| *i);
    for n in 0..sentinels.len() {
        let i = (start + n) % sentinels.len();
        let mut conn = match asking.take() {
            Some((at, c)) if at == i => c,
            _ => {
                let cfg = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(FOLLOW_EVERY))
                    .set_response_timeout(Some(FOLLOW_EVERY));
                let Ok(client) = super::client::client(sentinels[i].as_str(), tls) else {
                    continue;
                };
                match client
                    .get_multiplexed_async_connection_with_config(&cfg)
                    .await
                {
                    Ok(c) => c,
                    Err(_) => continue,
                }
            }
        };
        let asked: redis::RedisResult<Option<(String, u16)>> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(master_name)
            .query_async(&mut conn)
            .await;
        if let Ok(answer) = asked {
            *asking = Some((i, conn));
            if let Some((host, port)) = answer {
                return Some(format!("{host}:{port}"));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(named: &str) -> Watch {
        Watch {
            master_name: "tg".into(),
            state: Mutex::new(State {
                named: Some(named.into()),
                ..State::default()
            }),
        }
    }

    #[test]
    fn a_failover_heard_of_moves_connections_before_the_sentinels_name_the_new_master() {
        let w = watch("10.0.0.1:6379");
        assert!(!w.is_stale("10.0.0.1:6379"));
        // Another master's failover changes nothing.
        w.event(
            "+selected-slave",
            "slave 10.0.0.9:6379 10.0.0.9 6379 @ other 10.0.0.8 6379",
        );
        assert!(!w.is_stale("10.0.0.1:6379"));
        assert_eq!(w.promoting(), None);
        w.event(
            "+selected-slave",
            "slave 10.0.0.2:6379 10.0.0.2 6379 @ tg 10.0.0.1 6379",
        );
        assert!(w.is_stale("10.0.0.1:6379"));
        assert!(!w.is_stale("10.0.0.2:6379"));
        assert_eq!(w.promoting().as_deref(), Some("10.0.0.2:6379"));
        // The sentinels still name the old master until they switch: the failover stands.
        let asked = Instant::now();
        w.named("10.0.0.1:6379".into(), asked);
        assert!(w.is_stale("10.0.0.1:6379"));
        w.event("+switch-master", "tg 10.0.0.1 6379 10.0.0.2 6379");
        assert_eq!(w.promoting(), None);
        assert!(w.is_stale("10.0.0.1:6379"));
        assert!(!w.is_stale("10.0.0.2:6379"));
        // An answer asked before the switch, or a sentinel that has not switched yet, does
        // not send connections back to the master it left.
        w.named("10.0.0.1:6379".into(), asked);
        w.named("10.0.0.1:6379".into(), Instant::now());
        assert!(w.is_stale("10.0.0.1:6379"));
        assert!(!w.is_stale("10.0.0.2:6379"));
        // A later failover is followed as ever.
        w.named("10.0.0.3:6379".into(), Instant::now());
        assert!(w.is_stale("10.0.0.2:6379"));
        assert!(!w.is_stale("10.0.0.3:6379"));
    }

    #[test]
    fn an_aborted_failover_sends_connections_back_to_the_master_named() {
        let w = watch("10.0.0.1:6379");
        w.event(
            "+promoted-slave",
            "slave 10.0.0.2:6379 10.0.0.2 6379 @ tg 10.0.0.1 6379",
        );
        assert!(w.is_stale("10.0.0.1:6379"));
        w.event("-failover-abort-slave-timeout", "master tg 10.0.0.1 6379");
        assert_eq!(w.promoting(), None);
        assert!(!w.is_stale("10.0.0.1:6379"));
        assert!(w.is_stale("10.0.0.2:6379"));
        // Malformed events change nothing.
        w.event("+selected-slave", "slave");
        w.event("+switch-master", "tg 10.0.0.1");
        assert!(!w.is_stale("10.0.0.1:6379"));
    }
}
