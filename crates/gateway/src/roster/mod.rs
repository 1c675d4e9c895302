//! Consumers managed at runtime through the admin API, over those the config lists: a
//! record per consumer the API created, changed or deleted, looked up on the request path
//! by key digest and by name (only while there is any), kept in an append-only change log
//! that survives restarts.

pub mod log;
pub mod record;
pub mod share;

use dashmap::DashMap;
use log::Log;
use parking_lot::Mutex;
use record::{parse_digest, Managed};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Why a change could not be kept.
#[derive(Debug, thiserror::Error)]
pub enum RosterError {
    /// The change log could not be written: the change is not applied.
    #[error("cannot write the change log {path}: {source}")]
    Log {
        /// The log's path.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// A key digest belongs to another consumer.
    #[error("a key is taken by consumer {0:?}")]
    KeyTaken(String),
    /// The change log could not be opened at start: changes would not survive a restart.
    #[error("consumer changes are not taken: {0}")]
    Unavailable(String),
}

/// Every managed consumer, by name and by key digest.
#[derive(Debug, Default)]
pub struct Roster {
    by_name: DashMap<Arc<str>, Arc<Managed>>,
    by_digest: DashMap<[u8; 32], Arc<str>>,
    /// Whether any record exists: until then the request path looks nothing up here.
    any: AtomicBool,
    /// Changes applied so far.
    changes: AtomicU64,
    /// The last version handed out.
    version: AtomicU64,
    /// Serializes changes (and their log lines).
    log: Mutex<Option<Log>>,
    /// Why changes are refused (the log could not be opened).
    broken: Option<String>,
    /// Every name with a record, in order, for paging.
    names: Mutex<std::collections::BTreeSet<Arc<str>>>,
    /// The compaction running, if one is (its thread).
    compaction: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Where changes made here go to be shared with other nodes (cluster mode).
    outbox: Mutex<Option<tokio::sync::mpsc::UnboundedSender<Managed>>>,
    /// Whether the change log did not exist when opened.
    new_log: bool,
    /// The change log's path (not behind `log`'s lock: a reload asks for it under it).
    log_path: Option<std::path::PathBuf>,
}

impl Roster {
    /// A roster kept only in memory.
    pub fn in_memory() -> Roster {
        Roster::default()
    }

    /// A roster that refuses changes, saying `why` (its log could not be opened).
    pub fn unavailable(why: String) -> Roster {
        Roster {
            broken: Some(why),
            ..Roster::default()
        }
    }

    /// A roster kept in the change log at `path`, with what the log holds applied. Torn
    /// lines are skipped (and named in the log).
    pub fn open(path: &Path) -> std::io::Result<Roster> {
        let (log, replayed) = Log::open(path)?;
        if !replayed.skipped.is_empty() {
            tracing::warn!(
                path = %path.display(),
                lines = ?replayed.skipped,
                "consumer change log: a torn last line (a crash mid-write) was skipped; the next change cuts it off"
            );
        }
        let roster = Roster::replayed(replayed, Some(path))?;
        *roster.log.lock() = Some(log);
        Ok(roster)
    }

    /// What the change log at `path` holds, read as [`Roster::open`] reads it but without
    /// taking the log (a running gateway may keep it), only to be set against a config
    /// (`tollgate check`).
    pub fn read(path: &Path) -> std::io::Result<Roster> {
        let (replayed, _, _) = log::read(path)?;
        Roster::replayed(replayed, None)
    }

    /// A roster of the records `replayed` (from the log at `path`, when it is kept).
    fn replayed(replayed: log::Replayed, path: Option<&Path>) -> std::io::Result<Roster> {
        let roster = Roster {
            new_log: replayed.missing,
            log_path: path.map(Path::to_path_buf),
            ..Roster::default()
        };
        for r in replayed.records {
            roster.apply(r);
        }
        // The API never gives one key to two live consumers: a log that does was edited.
        for r in roster.by_name.iter().filter(|r| !r.deleted) {
            for k in &r.keys {
                let owner = parse_digest(&k.sha256)
                    .and_then(|d| roster.by_digest.get(&d).map(|o| o.value().clone()));
                if let Some(o) = owner.filter(|o| **o != *r.name) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "it gives key {} to both {:?} and {o:?}; the admin API never does: mend or remove one of their lines",
                            k.id, r.name
                        ),
                    ));
                }
            }
        }
        Ok(roster)
    }

    /// Whether the change log did not exist yet when the roster opened it (the first
    /// change makes it).
    pub fn new_log(&self) -> bool {
        self.new_log
    }

    /// The change log the roster writes to (none when it keeps its changes in memory).
    pub fn log_path(&self) -> Option<&Path> {
        self.log_path.as_deref()
    }

    /// Why changes are refused, when the change log could not be read at start.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Whether no consumer is managed here.
    pub fn is_empty(&self) -> bool {
        !self.any.load(Ordering::Acquire)
    }

    /// How many records (deleted ones included).
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// The record of `name`, if the API has one.
    pub fn get(&self, name: &str) -> Option<Arc<Managed>> {
        self.by_name.get(name).map(|r| r.value().clone())
    }

    /// The managed consumer holding the key with this digest.
    pub fn by_digest(&self, digest: &[u8; 32]) -> Option<Arc<Managed>> {
        let name = self.by_digest.get(digest)?.value().clone();
        self.get(&name).filter(|r| !r.deleted)
    }

    /// Every record, sorted by name, from after `after`, at most `limit`; the deleted ones
    /// too only when `deleted`.
    pub fn page(&self, after: Option<&str>, limit: usize, deleted: bool) -> Vec<Arc<Managed>> {
        use std::ops::Bound;
        let mut out = Vec::with_capacity(limit.min(1024));
        let mut from: Option<Arc<str>> = after.map(Arc::from);
        loop {
            // A stretch of names at a time: the records are read without the names' lock.
            let names: Vec<Arc<str>> = {
                let all = self.names.lock();
                let start = match from.as_deref() {
                    Some(a) => Bound::Excluded(a),
                    None => Bound::Unbounded,
                };
                all.range::<str, _>((start, Bound::Unbounded))
                    .take(limit)
                    .cloned()
                    .collect()
            };
            let ended = names.len() < limit;
            from = names.last().cloned();
            out.extend(
                names
                    .iter()
                    .filter_map(|n| self.get(n))
                    .filter(|m| deleted || !m.deleted),
            );
            if ended || out.len() >= limit {
                out.truncate(limit);
                return out;
            }
        }
    }

    /// A version above every one seen: the time in milliseconds, times 1024, or one more
    /// than the last.
    pub fn next_version(&self) -> u64 {
        let now = unix_millis() << 10;
        let mut last = self.version.load(Ordering::Acquire);
        loop {
            let next = now.max(last.saturating_add(1));
            match self
                .version
                .compare_exchange(last, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return next,
                Err(seen) => last = seen,
            }
        }
    }

    /// Applies `r` in memory if it is newer than the record of its name. Returns whether it
    /// was applied.
    pub fn apply(&self, r: Managed) -> bool {
        let _serial = self.log.lock();
        self.apply_locked(r)
    }

    fn apply_locked(&self, r: Managed) -> bool {
        let name: Arc<str> = Arc::from(r.name.as_str());
        let old = self.get(&name);
        if old.as_ref().is_some_and(|o| o.version >= r.version) {
            return false;
        }
        self.version.fetch_max(r.version, Ordering::AcqRel);
        // The new keys first, then the record, then the keys it no longer has: a key the
        // change keeps is never missing in between.
        let digests = |m: &Managed| -> Vec<[u8; 32]> {
            if m.deleted {
                return Vec::new();
            }
            m.keys
                .iter()
                .filter_map(|k| parse_digest(&k.sha256))
                .collect()
        };
        let now = digests(&r);
        for d in &now {
            self.by_digest.insert(*d, name.clone());
        }
        self.names.lock().insert(name.clone());
        self.by_name.insert(name.clone(), Arc::new(r));
        if let Some(old) = old {
            for d in digests(&old).iter().filter(|d| !now.contains(d)) {
                self.by_digest.remove_if(d, |_, owner| *owner == name);
            }
        }
        self.changes.fetch_add(1, Ordering::AcqRel);
        self.any.store(true, Ordering::Release);
        true
    }

    /// Counts every change applied: what was derived from the records (a verified token's
    /// consumer) is looked at again when it moves.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// Applies records other nodes made, the newer ones, and keeps those in the change log
    /// too (one sync for all), so a restart without Redis still has them. Returns how
    /// many were newer. Blocks on the disk: call it off the async threads.
    pub fn absorb(self: &Arc<Self>, records: Vec<Managed>) -> usize {
        let mut log = self.log.lock();
        let now_ceiling = unix_millis().saturating_add(86_400_000) << 10;
        let mut kept = Vec::new();
        for r in records {
            // A version more than a day ahead would freeze the consumer: refused.
            if r.version > now_ceiling {
                tracing::warn!(consumer = %r.name, "a shared consumer change dated more than a day ahead is ignored");
                continue;
            }
            let line = r.clone();
            if self.apply_locked(r) {
                kept.push(line);
            }
        }
        if let (Some(l), false) = (log.as_mut(), kept.is_empty()) {
            if let Err(e) = self.keep(l, &kept) {
                tracing::warn!(path = %l.path().display(), "shared consumer changes are applied but not logged: {e}");
            }
            self.compact_if_due(l);
        }
        kept.len()
    }

    /// The records whose version is above what `theirs` holds for their name (or that it
    /// lacks).
    pub fn newer_than(&self, theirs: &std::collections::HashMap<String, u64>) -> Vec<Managed> {
        self.by_name
            .iter()
            .filter(|r| theirs.get(r.key().as_ref()).is_none_or(|v| *v < r.version))
            .map(|r| (**r.value()).clone())
            .collect()
    }

    /// Changes the record of `name` under the roster's lock, so that two changes of one
    /// consumer never undo each other: `change` gets the record now (or `None`) and makes
    /// the new one; its version is set here, above every one seen. The change is written
    /// to the log (and synced) before it is applied: a change answered is a change kept.
    /// A key digest held by another live consumer refuses it. Blocks on the disk.
    pub fn update<E: From<RosterError>>(
        self: &Arc<Self>,
        name: &str,
        change: impl FnOnce(Option<&Managed>) -> Result<Managed, E>,
    ) -> Result<Managed, E> {
        if let Some(why) = &self.broken {
            return Err(RosterError::Unavailable(why.clone()).into());
        }
        let mut log = self.log.lock();
        let now = self.get(name);
        let mut r = change(now.as_deref())?;
        r.version = self.next_version();
        if !r.deleted {
            for k in &r.keys {
                let owner = parse_digest(&k.sha256)
                    .and_then(|d| self.by_digest.get(&d).map(|o| o.value().clone()));
                if let Some(o) = owner.filter(|o| **o != *r.name) {
                    return Err(RosterError::KeyTaken(o.to_string()).into());
                }
            }
        }
        if let Some(l) = log.as_mut() {
            self.keep(l, std::slice::from_ref(&r))
                .map_err(|source| RosterError::Log {
                    path: l.path().display().to_string(),
                    source,
                })?;
        }
        self.apply_locked(r.clone());
        if let Some(out) = self.outbox.lock().as_ref() {
            let _ = out.send(r.clone());
        }
        if let Some(l) = log.as_mut() {
            self.compact_if_due(l);
        }
        Ok(r)
    }

    /// Writes `new` records to the log: appended, or, when another hand removed, replaced
    /// or changed the file since the last change, the whole roster written again with them
    /// (those of their names replaced). Under the log's lock.
    fn keep(&self, l: &mut Log, new: &[Managed]) -> std::io::Result<()> {
        if l.append_all(new)? {
            return Ok(());
        }
        tracing::warn!(path = %l.path().display(), "the consumer change log was removed, replaced or changed by another hand; written again with every consumer");
        let names: std::collections::HashSet<&str> = new.iter().map(|r| r.name.as_str()).collect();
        let live: Vec<Arc<Managed>> = self
            .by_name
            .iter()
            .filter(|r| !names.contains(r.key().as_ref()))
            .map(|r| r.value().clone())
            .collect();
        l.rewrite(live.iter().map(|r| r.as_ref()).chain(new.iter()))
    }

    /// Rewrites the log with one line per record, on a thread of its own, when it has
    /// grown past twice that: changes go on meanwhile (those made while the records are
    /// written are added before the new log replaces the old).
    fn compact_if_due(self: &Arc<Self>, l: &mut Log) {
        if !l.wants_compaction(self.by_name.len() as u64) {
            return;
        }
        let Some(aside) = l.begin_compaction() else {
            return;
        };
        let records: Vec<Arc<Managed>> = self.by_name.iter().map(|r| r.value().clone()).collect();
        let roster = Arc::clone(self);
        let (path, aside_again) = (l.path().to_path_buf(), aside.clone());
        let spawned = std::thread::Builder::new()
            .name("consumers-log".into())
            .spawn(move || {
                let written = Log::write_aside(&aside, records.iter().map(|r| r.as_ref()));
                let mut log = roster.log.lock();
                let Some(l) = log.as_mut() else { return };
                if let Err(e) = written.and_then(|n| l.finish_compaction(&aside, n)) {
                    l.abandon_compaction(&aside);
                    tracing::warn!(path = %l.path().display(), "consumer change log not compacted: {e}");
                }
            });
        match spawned {
            Ok(thread) => *self.compaction.lock() = Some(thread),
            Err(e) => {
                l.abandon_compaction(&aside_again);
                tracing::warn!(path = %path.display(), "consumer change log not compacted: {e}");
            }
        }
    }

    /// Runs `f` with no change made meanwhile: a reload checks its config against the
    /// records and swaps it in under this, so a change checked against the old config
    /// cannot slip in between.
    pub fn unchanged<T>(&self, f: impl FnOnce() -> T) -> T {
        let _serial = self.log.lock();
        f()
    }

    /// What a config would contradict in the records here, each as a problem with its
    /// place: a key it gives to one consumer while a record gives it to another (one key,
    /// one consumer), a plan a record names that it does not define (the consumer would
    /// go unlimited).
    pub fn conflicts(&self, config: &tollgate_config::Config) -> Vec<tollgate_config::Problem> {
        let mut found = Vec::new();
        // The log is opened at start and written to until the gateway stops: a config
        // that keeps the changes elsewhere would, at the next start, read a log without
        // them (deleted consumers and revoked keys back).
        if let Some(running) = self.log_path() {
            let kept = config
                .consumers_log
                .as_deref()
                .is_some_and(|l| tollgate_config::same_file(l, running));
            if !kept {
                let to = config
                    .consumers_log
                    .as_deref()
                    .map_or("no change log".to_string(), |l| l.display().to_string());
                found.push(tollgate_config::Problem::new(
                    "consumers_log",
                    format!(
                        "this config keeps the consumers' changes in {to}, but the gateway writes them to {} until it stops; the log moves only at a restart: stop the gateway, move the file, then start it",
                        running.display()
                    ),
                ));
            }
        }
        found.extend(self.missing_plans(config));
        found.extend(self.key_conflicts(config));
        found.sort_by(|a, b| a.message.cmp(&b.message));
        found
    }

    /// The keys `config` gives a consumer that a record gives another, each as a problem
    /// at `consumers`: a key names one consumer.
    pub fn key_conflicts(&self, config: &tollgate_config::Config) -> Vec<tollgate_config::Problem> {
        let consumers = &config.consumers;
        let mut found = Vec::new();
        for r in self.by_name.iter().filter(|r| !r.deleted) {
            for k in &r.keys {
                let Some(d) = parse_digest(&k.sha256) else {
                    continue;
                };
                let Some(i) = consumers.digest_owner(&d) else {
                    continue;
                };
                let listed = consumers.name(i);
                if listed != r.name {
                    found.push(tollgate_config::Problem::new(
                        "consumers",
                        format!(
                            "consumer {listed:?} is given a key that consumer {:?} holds through the admin API (key {}); a key names one consumer: remove it from the config, or revoke it first through the admin API of a running node (tollgate consumers key {} --revoke {})",
                            r.name, k.id, r.name, k.id
                        ),
                    ));
                }
            }
        }
        found.sort_by(|a, b| a.message.cmp(&b.message));
        found
    }

    /// The plans managed consumers are on that `config` does not define, each as a
    /// problem at `plans`: such a consumer is refused (503) while the config lacks it.
    pub fn missing_plans(&self, config: &tollgate_config::Config) -> Vec<tollgate_config::Problem> {
        let mut found = Vec::new();
        for r in self.by_name.iter().filter(|r| !r.deleted) {
            if let Some(plan) = r.plan.as_ref() {
                if !config.plans.iter().any(|p| p.name == *plan) {
                    found.push(tollgate_config::Problem::new(
                        "plans",
                        format!(
                            "consumer {:?}, managed through the admin API, is on plan {plan:?}, which this config does not define; move it to another plan first (tollgate consumers add {} --plan PLAN)",
                            r.name, r.name
                        ),
                    ));
                }
            }
        }
        found
    }

    /// Waits for the compaction running, if any (tests; a shutdown need not: the old log
    /// stays whole until the new one replaces it).
    pub fn compacted(&self) {
        let running = self.compaction.lock().take();
        if let Some(t) = running {
            let _ = t.join();
        }
    }
}

fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| {
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX >> 10)
        })
}

#[cfg(test)]
mod tests;
