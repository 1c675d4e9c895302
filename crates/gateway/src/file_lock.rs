//! One process keeps a file (the consumers' change log, the limit state): an advisory
//! lock (`flock`) on a file beside it, `<file>.lock`, held while it is open. A second
//! gateway naming the same file is refused at start, as Prometheus refuses a second
//! server on one data folder, instead of each rewriting it and undoing the other's work.
//! Within one process the lock is shared: a gateway started again in place may open the
//! file while the one it replaces is still alive.

use std::collections::HashMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The lock on a kept file, released when the last holder in this process drops it.
#[derive(Debug, Clone)]
pub struct FileLock {
    _file: Arc<File>,
}

/// Lock files held, by device and inode.
type Held = Mutex<HashMap<(u64, u64), Weak<File>>>;

/// The lock files this process holds.
fn held() -> &'static Held {
    static HELD: OnceLock<Held> = OnceLock::new();
    HELD.get_or_init(Default::default)
}

/// The lock file of the file at `kept`: its name with `.lock` added.
pub fn lock_path(kept: &Path) -> PathBuf {
    let mut name = kept.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

impl FileLock {
    /// Takes the lock of the file at `kept`. `Ok(None)` when the lock file cannot be made
    /// (its folder does not exist yet, or may not be written): the file is kept without
    /// it, and the next write tries again. An error (`ResourceBusy`) when another process
    /// holds it, saying `busy` after who holds it (`another process (pid 7) keeps this
    /// log (it holds X.lock); ` and then `busy`).
    pub fn take(kept: &Path, what: &str, busy: &str) -> std::io::Result<Option<FileLock>> {
        let path = lock_path(kept);
        // On a read-only disk or folder, the lock file a start made before is locked as
        // it is (a lock needs no write), else the kept file itself (SQLite's own locks
        // are `fcntl` ones, which a `flock` leaves alone): it names no process then.
        let (file, named) = match OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
        {
            Ok(f) => (f, true),
            Err(e) => match File::open(&path).or_else(|_| File::open(kept)) {
                Ok(f) => (f, false),
                Err(_) => {
                    tracing::debug!(path = %path.display(), "no lock on {what}: {e}");
                    return Ok(None);
                }
            },
        };
        let meta = file.metadata()?;
        let id = (meta.dev(), meta.ino());
        let mut held = held().lock().unwrap_or_else(|p| p.into_inner());
        held.retain(|_, w| w.strong_count() > 0);
        if let Some(ours) = held.get(&id).and_then(Weak::upgrade) {
            return Ok(Some(FileLock { _file: ours }));
        }
        let mut tries = 0;
        let taken = loop {
            match file.try_lock() {
                Err(TryLockError::WouldBlock)
                    if named && tries < 200 && holder(&file) == Some(mine()) =>
                {
                    // This process's own lock, on its way out: a handle closed here but
                    // still open in a child forked at that moment (until it runs its
                    // program), or dropped on another thread. Gone within moments.
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                other => break other,
            }
        };
        match taken {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let by = holder(&file)
                    .filter(|_| named)
                    .map_or(String::new(), |pid| format!(" (pid {pid})"));
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ResourceBusy,
                    format!(
                        "another process{by} keeps {what} (it holds {}); {busy}",
                        path.display()
                    ),
                ));
            }
            Err(TryLockError::Error(e)) => {
                tracing::debug!(path = %path.display(), "no lock on {what}: {e}");
                return Ok(None);
            }
        }
        // Who holds it, for the message another process gives.
        if !named {
            let file = Arc::new(file);
            held.insert(id, Arc::downgrade(&file));
            return Ok(Some(FileLock { _file: file }));
        }
        let _ = file.set_len(0);
        let _ = (&file).seek(std::io::SeekFrom::Start(0));
        let _ = (&file).write_all(format!("{}\n", mine()).as_bytes());
        let file = Arc::new(file);
        held.insert(id, Arc::downgrade(&file));
        Ok(Some(FileLock { _file: file }))
    }
}

/// This process's id, as the lock file names it.
fn mine() -> String {
    std::process::id().to_string()
}

/// The process the lock file names (its first line).
fn holder(mut file: &File) -> Option<String> {
    let mut text = String::new();
    file.seek(std::io::SeekFrom::Start(0)).ok()?;
    file.take(32).read_to_string(&mut text).ok()?;
    Some(text.trim().to_string()).filter(|p| !p.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tollgate-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

    #[test]
    fn one_process_shares_its_lock_and_names_itself_in_the_file() {
        let dir = folder("shared");
        let log = dir.join("c.changes");
        let a = FileLock::take(&log, "this log", "")
            .expect("take")
            .expect("made");
        let b = FileLock::take(&log, "this log", "").expect("shared in one process");
        assert!(b.is_some());
        let pid = std::fs::read_to_string(lock_path(&log)).expect("read");
        assert_eq!(pid.trim(), std::process::id().to_string());
        // Held: a file opened apart (as another process would) cannot take it.
        let apart = File::open(lock_path(&log)).expect("open");
        assert!(matches!(apart.try_lock(), Err(TryLockError::WouldBlock)));
        drop(apart);
        drop((a, b));
        // Released with its last holder: a file opened apart takes it (waiting, should a
        // child another test forks hold the closed handle until it runs its program).
        let f = File::open(lock_path(&log)).expect("open");
        f.lock().expect("free once dropped");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_lock_file_that_cannot_be_written_is_locked_as_it_is() {
        let dir = folder("read-only");
        let log = dir.join("state.db");
        drop(FileLock::take(&log, "this file", "").expect("take"));
        // Write-protected, as on a read-only disk: immutable for root, whom modes do not
        // stop, else by its mode.
        let lock = lock_path(&log);
        let immutable = |on: bool| {
            std::process::Command::new("chattr")
                .arg(if on { "+i" } else { "-i" })
                .arg(&lock)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !immutable(true) {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o444)).expect("mode");
        }
        assert!(
            OpenOptions::new().write(true).open(&lock).is_err(),
            "cannot write-protect {} here",
            lock.display()
        );
        let held = FileLock::take(&log, "this file", "").expect("take");
        let apart = File::open(&lock).expect("open");
        let taken = apart.try_lock();
        immutable(false);
        assert!(held.is_some(), "no lock taken");
        assert!(matches!(taken, Err(TryLockError::WouldBlock)), "{taken:?}");
        drop((held, apart));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_folder_not_made_yet_gives_no_lock_and_no_error() {
        let dir = folder("later");
        let log = dir.join("later").join("c.changes");
        assert!(FileLock::take(&log, "this log", "")
            .expect("no error")
            .is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
