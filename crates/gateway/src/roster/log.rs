//! The change log: one JSON line per change, appended and synced before the change is
//! answered, replayed at start (the last line of a name wins). When it holds more than
//! twice the live records it is rewritten with one line each (written aside, synced,
//! renamed over), so a change costs one line however many consumers there are.

use super::record::Managed;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

/// Lines a log may hold beyond twice its live records before it is compacted.
const SLACK: u64 = 1024;

/// An open change log.
#[derive(Debug)]
pub struct Log {
    path: PathBuf,
    /// Opened (and the file made) by the first change.
    file: Option<File>,
    lines: u64,
}

/// What a log held when it was opened.
#[derive(Debug, Default)]
pub struct Replayed {
    /// Every record, in file order.
    pub records: Vec<Managed>,
    /// Lines that were not a record (a torn last line after a crash), by line number.
    pub skipped: Vec<usize>,
}

impl Log {
    /// Opens (or creates) the log at `path` and reads what it holds.
    pub fn open(path: &Path) -> std::io::Result<(Log, Replayed)> {
        let mut replayed = Replayed::default();
        let mut lines = 0;
        match File::open(path) {
            Ok(f) => {
                for (i, line) in BufReader::new(f).lines().enumerate() {
                    let line = line?;
                    if line.trim().is_empty() {
                        continue;
                    }
                    lines += 1;
                    match serde_json::from_str::<Managed>(&line) {
                        Ok(r) => replayed.records.push(r),
                        Err(_) => replayed.skipped.push(i + 1),
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok((
            Log {
                path: path.to_path_buf(),
                file: None,
                lines,
            },
            replayed,
        ))
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record and syncs it to disk.
    pub fn append(&mut self, r: &Managed) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(r)?;
        line.push(b'\n');
        let file = match &mut self.file {
            Some(f) => f,
            None => self.file.insert(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)?,
            ),
        };
        file.write_all(&line)?;
        file.sync_data()?;
        self.lines += 1;
        Ok(())
    }

    /// Whether the log holds enough dead lines to be rewritten, given `live` records.
    pub fn wants_compaction(&self, live: u64) -> bool {
        self.lines > live.saturating_mul(2) + SLACK
    }

    /// Rewrites the log with `live` only: beside it first, synced, then renamed over it.
    pub fn compact<'a>(&mut self, live: impl Iterator<Item = &'a Managed>) -> std::io::Result<()> {
        let aside = self.path.with_extension("compacting");
        let mut out = std::io::BufWriter::new(File::create(&aside)?);
        let mut n = 0;
        for r in live {
            serde_json::to_writer(&mut out, r)?;
            out.write_all(b"\n")?;
            n += 1;
        }
        let f = out.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        std::fs::rename(&aside, &self.path)?;
        self.file = Some(OpenOptions::new().append(true).open(&self.path)?);
        self.lines = n;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(name: &str, version: u64) -> Managed {
        Managed {
            name: name.into(),
            plan: None,
            keys: vec![],
            metadata: Default::default(),
            deleted: false,
            version,
        }
    }

    #[test]
    fn appends_replay_and_compaction_keeps_the_live_records() {
        let dir = std::env::temp_dir().join(format!("tollgate-roster-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("consumers.changes");
        let _ = std::fs::remove_file(&path);
        let (mut log, r) = Log::open(&path).expect("open");
        assert!(r.records.is_empty());
        for v in 1..=3 {
            log.append(&rec("alice", v)).expect("append");
        }
        // A torn last line, as a crash mid-write leaves it.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(b"{\"name\":\"bo"))
            .expect("torn");
        let (mut log, r) = Log::open(&path).expect("reopen");
        assert_eq!(r.records.len(), 3);
        assert_eq!(r.skipped, vec![4]);
        assert!(!log.wants_compaction(1));
        log.compact([rec("alice", 3)].iter()).expect("compact");
        log.append(&rec("bob", 4)).expect("append");
        let (_, r) = Log::open(&path).expect("again");
        assert_eq!(r.records, vec![rec("alice", 3), rec("bob", 4)]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
