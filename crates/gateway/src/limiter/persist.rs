//! Limit counters kept on disk (`state: {path, flush_interval}`), so a restart does not
//! hand every consumer a fresh window.
//!
//! A cell that counts a request while clean is queued once; every `flush_interval` a
//! thread writes the queued cells' windows to SQLite in one transaction (WAL, so a
//! `kill -9` loses at most the admissions since the last write), and once more on shutdown.
//! Each row keeps the clocks it was written at, so on start its counts are placed on the
//! new process's clock: a count stays as long as it had left to live (the wall time since
//! the write is taken off; a slot boundary in between rounds towards counting longer, never
//! shorter). Windows that have passed are dropped. A state file whose content cannot be read is
//! reported with its path and set aside, and the node starts empty; one that cannot be
//! written is reported and counted while the gateway goes on serving.

use super::{Counter, DirtyQueue, Now, Window, SLOTS, SUB};
use crate::clock::Clock;
use crate::file_lock::FileLock;
use parking_lot::{Condvar, Mutex};
use rusqlite::{params, Connection};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tollgate_config::StateConfig;

const SCHEMA: &str = "
PRAGMA journal_mode = WAL;
PRAGMA synchronous = NORMAL;
CREATE TABLE IF NOT EXISTS windows (
    key TEXT PRIMARY KEY,
    wall INTEGER NOT NULL,
    mono INTEGER NOT NULL,
    slot_ns INTEGER NOT NULL,
    head INTEGER NOT NULL,
    slots BLOB NOT NULL,
    expires INTEGER NOT NULL
) WITHOUT ROWID;
";

/// A window as written: the clocks it was written at, and its slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    wall: u64,
    mono: u64,
    slot_ns: u64,
    window: Window,
}

fn ceil_div(a: i128, b: i128) -> i128 {
    -((-a).div_euclid(b))
}

impl Saved {
    /// Wall-clock nanoseconds at which its newest count stops counting.
    fn expires(&self) -> u64 {
        let end = (i128::from(self.window.head) + SLOTS as i128) * i128::from(self.slot_ns)
            - i128::from(self.mono);
        u64::try_from(i128::from(self.wall) + end.max(0)).unwrap_or(u64::MAX)
    }

    /// The window placed on the clock of `now`: each count keeps what it had left to live.
    pub(crate) fn window_at(&self, slot_ns: u64, now: Now) -> Window {
        let mut out = Window::default();
        if slot_ns != self.slot_ns || slot_ns == 0 {
            return out;
        }
        let slot = i128::from(slot_ns);
        // A wall clock that went back counts as no time passed.
        let elapsed = i128::from(now.wall.saturating_sub(self.wall));
        let head = i128::from(self.window.head);
        let mut placed: Vec<(i128, u64)> = Vec::with_capacity(SLOTS);
        for k in head - i128::from(SUB)..=head {
            let n = self.window.slots[k.rem_euclid(SLOTS as i128) as usize];
            if n == 0 {
                continue;
            }
            let left = (k + SLOTS as i128) * slot - i128::from(self.mono) - elapsed;
            if left <= 0 {
                continue;
            }
            // The first slot on the new clock that counts at least as long.
            let k2 = ceil_div(left + i128::from(now.mono), slot) - SLOTS as i128;
            placed.push((k2, n));
        }
        let current = i128::from(now.mono / slot_ns);
        let new_head = placed.iter().map(|p| p.0).fold(current, i128::max);
        for (k2, n) in placed {
            let k2 = k2.max(new_head - i128::from(SUB));
            out.slots[k2.rem_euclid(SLOTS as i128) as usize] += n;
            out.total += n;
        }
        out.head = u64::try_from(new_head).unwrap_or(0);
        out
    }

    fn slots_blob(&self) -> Vec<u8> {
        self.window
            .slots
            .iter()
            .flat_map(|n| n.to_le_bytes())
            .collect()
    }

    fn from_row(wall: i64, mono: i64, slot_ns: i64, head: i64, blob: &[u8]) -> Option<Saved> {
        if blob.len() != SLOTS * 8 {
            return None;
        }
        let mut window = Window::default();
        for (i, chunk) in blob.chunks_exact(8).enumerate() {
            let n = u64::from_le_bytes(chunk.try_into().ok()?);
            window.slots[i] = n;
            window.total = window.total.checked_add(n)?;
        }
        window.head = u64::try_from(head).ok()?;
        Some(Saved {
            wall: u64::try_from(wall).ok()?,
            mono: u64::try_from(mono).ok()?,
            slot_ns: u64::try_from(slot_ns).ok().filter(|&s| s > 0)?,
            window,
        })
    }
}

/// The windows read at start, by cell key.
pub type Restored = HashMap<Arc<str>, Saved>;

/// Why the state file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Another gateway keeps it.
    #[error("state file {path}: {source}")]
    Busy {
        /// The file.
        path: String,
        /// Who holds it.
        source: std::io::Error,
    },
    /// SQLite refused.
    #[error("state file {path}: {source}")]
    Db {
        /// The file.
        path: String,
        /// What SQLite said.
        source: rusqlite::Error,
    },
}

fn db_err(path: &Path) -> impl Fn(rusqlite::Error) -> StateError + '_ {
    move |source| StateError::Db {
        path: path.display().to_string(),
        source,
    }
}

/// The lock on the state file at `path`: `None` when its lock file cannot be made yet.
fn take_lock(path: &Path) -> Result<Option<FileLock>, StateError> {
    FileLock::take(
        path,
        "this state file",
        "give each gateway its own state.path",
    )
    .map_err(|source| StateError::Busy {
        path: path.display().to_string(),
        source,
    })
}

fn open_db(path: &Path) -> Result<Connection, StateError> {
    crate::sqlite::open(path, SCHEMA, crate::sqlite::OURS).map_err(db_err(path))
}

/// The file counters are kept in: `path`, or `state.db` inside it when it is a folder.
fn file_of(path: &Path) -> PathBuf {
    if path.is_dir() {
        let file = path.join("state.db");
        tracing::info!(folder = %path.display(), file = %file.display(), "state.path is a folder; counters are kept in a file inside it");
        file
    } else {
        path.to_path_buf()
    }
}

/// Whether SQLite refused a file for what it holds (not a database, damaged), rather than
/// for where it is (permissions, a read-only disk, a missing folder).
fn is_unsound(e: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode::{DatabaseCorrupt, NotADatabase};
    match e {
        // (`PRAGMA quick_check` finding damage says `DatabaseCorrupt` too.)
        rusqlite::Error::SqliteFailure(f, _) => matches!(f.code, NotADatabase | DatabaseCorrupt),
        _ => false,
    }
}

/// Moves an unreadable state file aside to `PATH.corrupt` (with its journal files gone), so
/// it can be looked at and a fresh one takes its place.
fn set_aside(path: &Path) {
    let aside = PathBuf::from(format!("{}.corrupt", path.display()));
    match std::fs::rename(path, &aside) {
        Ok(()) => {
            for ext in ["-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{ext}", path.display()));
            }
            tracing::warn!(path = %path.display(), aside = %aside.display(), "unreadable state file moved aside");
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), "unreadable state file not moved aside: {e}")
        }
    }
}

fn read_all(c: &Connection, wall: u64) -> rusqlite::Result<HashMap<Arc<str>, Saved>> {
    let mut stmt =
        c.prepare("SELECT key, wall, mono, slot_ns, head, slots FROM windows WHERE expires > ?1")?;
    let rows = stmt.query_map([i64::try_from(wall).unwrap_or(i64::MAX)], |r| {
        let key: String = r.get(0)?;
        let blob: Vec<u8> = r.get(5)?;
        Ok((
            key,
            Saved::from_row(r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, &blob),
        ))
    })?;
    let mut out = HashMap::new();
    for row in rows {
        if let (key, Some(saved)) = row? {
            out.insert(Arc::from(key), saved);
        }
    }
    Ok(out)
}

/// Counters about the state file, for `/metrics`.
#[derive(Debug, Default)]
pub struct StateStats {
    /// Rounds done (with or without anything to write).
    pub flushes: AtomicU64,
    /// Windows written.
    pub windows: AtomicU64,
    /// Opens or writes that failed.
    pub errors: AtomicU64,
}

/// The state file and the cells waiting to be written to it.
pub struct StateStore {
    path: PathBuf,
    db: Mutex<Option<Connection>>,
    /// Held while the store lives: one process keeps the file (taken when the file is
    /// opened, at start or at the first write that can).
    lock: Mutex<Option<FileLock>>,
    /// Cells with counts not yet written.
    pub queue: Arc<DirtyQueue>,
    clock: Arc<dyn Clock>,
    /// Figures for `/metrics`.
    pub stats: Arc<StateStats>,
    failing: std::sync::atomic::AtomicBool,
    last_prune: AtomicU64,
    stop: (Mutex<bool>, Condvar),
}

impl std::fmt::Debug for StateStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl StateStore {
    /// Opens the state file and reads the windows that have not passed. A path that is a
    /// folder holds the file as `state.db`. A file whose content is not a sound database is
    /// reported, moved aside (`.corrupt`) and replaced by an empty one; one that cannot be
    /// opened for writing (permissions, a read-only disk, a missing folder) is read if it
    /// can be, reported and left as it is, and writing is tried again at each flush; a
    /// database of something else is left untouched and not used. An error when another
    /// process keeps the file: two gateways would each restore and overwrite the other's
    /// counts.
    pub fn open(
        cfg: &StateConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<(Arc<StateStore>, Restored), StateError> {
        let path = file_of(&cfg.path);
        let lock = take_lock(&path)?;
        let stats = Arc::new(StateStats::default());
        let existed = path.exists();
        let wall = clock.wall_nanos();
        // With whether a failure is the file's content: an open refused as not a sound
        // database, or a database whose windows cannot be read (another schema).
        let opened = crate::sqlite::open(&path, SCHEMA, crate::sqlite::OURS)
            .map_err(|e| (is_unsound(&e), e))
            .and_then(|c| {
                let saved = read_all(&c, wall).map_err(|e| (true, e))?;
                Ok((c, saved))
            });
        let (db, saved) = match opened {
            Ok((c, saved)) => {
                if existed {
                    tracing::info!(path = %path.display(), windows = saved.len(), "limit counters restored");
                } else {
                    tracing::info!(path = %path.display(), "no state file yet; counters start empty");
                }
                (Some(c), saved)
            }
            Err((unsound, e)) => {
                stats.errors.fetch_add(1, Ordering::Relaxed);
                let bad_content = unsound && path.is_file();
                let foreign = crate::sqlite::is_foreign(&e);
                // A sound file that cannot be written here (a read-only disk or folder)
                // still has the counts to restore: its rows are kept until they are
                // written again.
                let kept = (!bad_content && !foreign && path.is_file())
                    .then(|| crate::sqlite::open_read_only(&path).and_then(|c| read_all(&c, wall)))
                    .and_then(Result::ok);
                match &kept {
                    Some(saved) => tracing::error!(
                        windows = saved.len(),
                        "{}; limit counters restored from it read-only, written once it can be",
                        db_err(&path)(e)
                    ),
                    None => tracing::error!("{}; counters start empty", db_err(&path)(e)),
                }
                // A fresh file where a bad one was; otherwise the first flush tries again.
                let db = bad_content.then(|| {
                    set_aside(&path);
                    open_db(&path).ok()
                });
                (db.flatten(), kept.unwrap_or_default())
            }
        };
        let store = Arc::new(StateStore {
            path,
            db: Mutex::new(db),
            lock: Mutex::new(lock),
            queue: Arc::default(),
            clock,
            stats,
            failing: Default::default(),
            last_prune: AtomicU64::new(0),
            stop: (Mutex::new(false), Condvar::new()),
        });
        Ok((store, saved))
    }

    /// Writes every queued cell's window. Returns how many were written; on failure the
    /// cells stay queued for the next try.
    pub fn flush(&self) -> usize {
        let cells = std::mem::take(&mut *self.queue.lock());
        if cells.is_empty() {
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
            return 0;
        }
        let now = Now {
            mono: self.clock.now_nanos(),
            wall: self.clock.wall_nanos(),
        };
        let mut rows: Vec<(Arc<str>, Saved)> = Vec::with_capacity(cells.len());
        for cell in &cells {
            let mut st = cell.state.lock();
            st.dirty = false;
            if let Counter::Local(w) = &st.counter {
                rows.push((
                    cell.key.clone(),
                    Saved {
                        wall: now.wall,
                        mono: now.mono,
                        slot_ns: cell.slot_ns(),
                        window: w.clone(),
                    },
                ));
            }
        }
        match self.write(&rows, now.wall) {
            Ok(()) => {
                self.stats.flushes.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .windows
                    .fetch_add(rows.len() as u64, Ordering::Relaxed);
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(path = %self.path.display(), "state file written again");
                }
                rows.len()
            }
            Err(e) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        "{e}; counters are kept in memory and written once it works again"
                    );
                }
                // Queue them again (a cell counted meanwhile is queued already). The queue
                // is locked only after the cells: a request holds its cells' locks while it
                // queues them, so taking the queue first could deadlock.
                let again: Vec<_> = cells
                    .into_iter()
                    .filter(|cell| {
                        let mut st = cell.state.lock();
                        !std::mem::replace(&mut st.dirty, true)
                    })
                    .collect();
                self.queue.lock().extend(again);
                0
            }
        }
    }

    fn write(&self, rows: &[(Arc<str>, Saved)], wall: u64) -> Result<(), StateError> {
        let mut db = self.db.lock();
        if db.is_none() {
            let mut lock = self.lock.lock();
            if lock.is_none() {
                *lock = take_lock(&self.path)?;
            }
            *db = Some(open_db(&self.path)?);
        }
        let Some(c) = db.as_mut() else {
            return Ok(());
        };
        let path = self.path.as_path();
        let tx = c.transaction().map_err(db_err(path))?;
        {
            let mut stmt = tx
                .prepare_cached(
                    "INSERT INTO windows (key, wall, mono, slot_ns, head, slots, expires)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
                     ON CONFLICT (key) DO UPDATE SET wall = excluded.wall, mono = excluded.mono,
                       slot_ns = excluded.slot_ns, head = excluded.head, slots = excluded.slots,
                       expires = excluded.expires",
                )
                .map_err(db_err(path))?;
            let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            for (key, s) in rows {
                stmt.execute(params![
                    &**key,
                    i(s.wall),
                    i(s.mono),
                    i(s.slot_ns),
                    i(s.window.head),
                    s.slots_blob(),
                    i(s.expires()),
                ])
                .map_err(db_err(path))?;
            }
        }
        // Passed windows go once a minute.
        let minute = wall / 60_000_000_000;
        if self.last_prune.swap(minute, Ordering::Relaxed) != minute {
            tx.execute(
                "DELETE FROM windows WHERE expires <= ?1",
                [i64::try_from(wall).unwrap_or(i64::MAX)],
            )
            .map_err(db_err(path))?;
        }
        tx.commit().map_err(db_err(path))
    }

    /// Writes every `every` on a thread of its own until [`StateStore::stop`].
    pub fn spawn_flusher(self: &Arc<Self>, every: Duration) -> std::thread::JoinHandle<()> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("tollgate-state".into())
            .spawn(move || loop {
                {
                    let mut stopped = me.stop.0.lock();
                    if !*stopped {
                        me.stop.1.wait_for(&mut stopped, every);
                    }
                    if *stopped {
                        return;
                    }
                }
                me.flush();
            })
            .unwrap_or_else(|e| {
                tracing::error!("cannot start the state writer thread: {e}");
                std::thread::spawn(|| {})
            })
    }

    /// Stops the flusher thread (the caller writes a last time with [`StateStore::flush`]).
    pub fn stop(&self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn saved(wall: u64, mono: u64, slot_ns: u64, head: u64, counts: &[(u64, u64)]) -> Saved {
        let mut window = Window {
            head,
            ..Window::default()
        };
        for &(k, n) in counts {
            window.slots[(k % SLOTS as u64) as usize] += n;
            window.total += n;
        }
        Saved {
            wall,
            mono,
            slot_ns,
            window,
        }
    }

    #[test]
    fn counts_keep_the_time_they_had_left_on_a_new_clock() {
        // 10 s window, 1 s slots. Written at mono 50.5 s: slot 50 has 3 counts, slot 45
        // has 2. Slot 50 stops counting at 61 s (10.5 s left), slot 45 at 56 s (5.5 s).
        let s = saved(1_000 * S, 50 * S + S / 2, S, 50, &[(50, 3), (45, 2)]);
        // Restored 2 s later (wall) on a clock that started a moment ago (mono 0.25 s).
        let w = s.window_at(
            S,
            Now {
                mono: S / 4,
                wall: 1_002 * S,
            },
        );
        assert_eq!(w.total, 5);
        // 8.5 s left → must count until mono ≥ 8.75 s: slot k with (k + 11) s ≥ 8.75 s → k = -2.
        // 3.5 s left → until 3.75 s → k = -7.
        assert_eq!(w.head, 0);
        assert_eq!(w.slots[(-2i64).rem_euclid(11) as usize], 3);
        assert_eq!(w.slots[(-7i64).rem_euclid(11) as usize], 2);
        // Advancing the clock drops them exactly when they are due.
        let mut w2 = w.clone();
        w2.advance(4); // mono 4 s: slot -7 ended at 4 s
        assert_eq!(w2.total, 3);
        w2.advance(9);
        assert_eq!(w2.total, 0);
    }

    #[test]
    fn passed_windows_are_dropped_and_a_clock_gone_back_counts_as_no_time() {
        let s = saved(1_000 * S, 20 * S, S, 20, &[(20, 4)]);
        let late = s.window_at(
            S,
            Now {
                mono: 0,
                wall: 1_020 * S,
            },
        );
        assert_eq!(late.total, 0);
        let back = s.window_at(
            S,
            Now {
                mono: 0,
                wall: 900 * S,
            },
        );
        assert_eq!(back.total, 4);
        // All 11 s of its life are left.
        assert_eq!(back.wait_for(4, S, 0), 11 * S);
    }

    #[test]
    fn a_month_window_survives_a_restart() {
        // 30 days, slots of 3 days: 1000 counts made 10 days before the write.
        let slot = 3 * 86_400 * S;
        let mono = 40 * 86_400 * S;
        let s = saved(
            5_000_000 * S,
            mono,
            slot,
            mono / slot,
            &[(mono / slot - 3, 1000)],
        );
        let w = s.window_at(
            slot,
            Now {
                mono: S,
                wall: 5_000_000 * S + 3600 * S,
            },
        );
        assert_eq!(w.total, 1000);
        assert_eq!(
            Saved::from_row(1, 2, 3, 4, &s.slots_blob()).map(|x| x.window.total),
            Some(1000)
        );
    }
}
