//! The change log: one JSON line per change, appended and synced before the change is
//! answered, replayed at start (the last line of a name wins). When it holds more than
//! twice the live records it is rewritten with one line each (written aside, synced,
//! renamed over), so a change costs one line however many consumers there are.

use super::record::Managed;
use std::fs::{File, OpenOptions};
use std::io::Write;
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
    /// The file ends without a newline (a torn last line): the next line starts on a
    /// line of its own.
    torn: bool,
    /// While a compaction runs: the records appended since it began.
    compacting: Option<Vec<Managed>>,
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
    /// Opens the log at `path` (made by the first change) and reads what it holds. Lines
    /// that are not a record (a torn last line after a crash, bytes that are not UTF-8)
    /// are skipped and named; a log that cannot be read at all is an error.
    pub fn open(path: &Path) -> std::io::Result<(Log, Replayed)> {
        let mut replayed = Replayed::default();
        let mut lines = 0;
        let mut torn = false;
        match std::fs::read(path) {
            Ok(bytes) => {
                torn = bytes.last().is_some_and(|b| *b != b'\n');
                for (i, line) in bytes.split(|b| *b == b'\n').enumerate() {
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    lines += 1;
                    match serde_json::from_slice::<Managed>(line) {
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
                torn,
                compacting: None,
            },
            replayed,
        ))
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends records and syncs them to disk, once for all.
    pub fn append_all(&mut self, records: &[Managed]) -> std::io::Result<()> {
        let mut out = Vec::new();
        if std::mem::take(&mut self.torn) {
            out.push(b'\n');
        }
        for r in records {
            serde_json::to_writer(&mut out, r)?;
            out.push(b'\n');
        }
        let made = self.file.is_none() && !self.path.exists();
        let file = match &mut self.file {
            Some(f) => f,
            None => self.file.insert(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)?,
            ),
        };
        file.write_all(&out)?;
        file.sync_data()?;
        if made {
            sync_dir(&self.path);
        }
        self.lines += records.len() as u64;
        if let Some(since) = &mut self.compacting {
            since.extend(records.iter().cloned());
        }
        Ok(())
    }

    /// Whether the log holds enough dead lines to be rewritten, given `live` records.
    pub fn wants_compaction(&self, live: u64) -> bool {
        self.lines > live.saturating_mul(2) + SLACK
    }

    /// Starts a compaction: from now until it ends, appended records are also kept, to be
    /// added to the rewritten log. Returns where to write it, or `None` if one is running.
    pub fn begin_compaction(&mut self) -> Option<PathBuf> {
        if self.compacting.is_some() {
            return None;
        }
        self.compacting = Some(Vec::new());
        Some(self.path.with_extension("compacting"))
    }

    /// Writes `live` to `aside`, synced: the long part of a compaction, done without the
    /// log's lock. Returns how many lines.
    pub fn write_aside<'a>(
        aside: &Path,
        live: impl Iterator<Item = &'a Managed>,
    ) -> std::io::Result<u64> {
        let mut out = std::io::BufWriter::new(File::create(aside)?);
        let mut n = 0;
        for r in live {
            serde_json::to_writer(&mut out, r)?;
            out.write_all(b"\n")?;
            n += 1;
        }
        let f = out.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        Ok(n)
    }

    /// Ends a compaction: the records appended meanwhile are added to `aside` (`written`
    /// lines so far), which is then renamed over the log.
    pub fn finish_compaction(&mut self, aside: &Path, written: u64) -> std::io::Result<()> {
        let since = self.compacting.take().unwrap_or_default();
        let mut f = OpenOptions::new().append(true).open(aside)?;
        let mut out = Vec::new();
        for r in &since {
            serde_json::to_writer(&mut out, r)?;
            out.push(b'\n');
        }
        f.write_all(&out)?;
        f.sync_all()?;
        std::fs::rename(aside, &self.path)?;
        sync_dir(&self.path);
        self.file = Some(OpenOptions::new().append(true).open(&self.path)?);
        self.lines = written + since.len() as u64;
        self.torn = false;
        Ok(())
    }

    /// Gives a compaction up: the log stays as it is.
    pub fn abandon_compaction(&mut self, aside: &Path) {
        self.compacting = None;
        let _ = std::fs::remove_file(aside);
    }
}

/// Syncs the folder holding `path`, so that a file made or renamed there stays after a
/// power loss (best effort: not every file system can).
fn sync_dir(path: &Path) {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = File::open(dir).and_then(|d| d.sync_all());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever a crash or a stray editor leaves between the lines, every whole record
        /// is read back, in order, and nothing else is taken for one.
        #[test]
        fn replay_reads_every_record_and_skips_what_is_not_one(
            lines in prop::collection::vec(
                prop_oneof![
                    (0u64..1_000_000).prop_map(Ok),
                    prop::collection::vec(any::<u8>(), 0..40).prop_map(Err),
                ],
                0..30,
            )
        ) {
            let dir = std::env::temp_dir().join(format!("tollgate-log-prop-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("dir");
            let path = dir.join("p.changes");
            let mut bytes = Vec::new();
            let mut want = Vec::new();
            for l in &lines {
                match l {
                    Ok(v) => {
                        let r = rec(&format!("c{v}"), *v);
                        bytes.extend(serde_json::to_vec(&r).expect("json"));
                        want.push(r);
                    }
                    Err(junk) => bytes.extend(junk.iter().filter(|b| **b != b'\n')),
                }
                bytes.push(b'\n');
            }
            std::fs::write(&path, &bytes).expect("write");
            let (_, got) = Log::open(&path).expect("open");
            // Random bytes are never a record's JSON (an object with a name and a
            // version): what is read is exactly the records, in order.
            prop_assert_eq!(got.records, want);
        }
    }

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
            log.append_all(&[rec("alice", v)]).expect("append");
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
        // The line after a torn one is a line of its own, read back whole.
        log.append_all(&[rec("carol", 4)]).expect("append");
        let (mut log, r) = Log::open(&path).expect("again");
        assert_eq!(r.records.last(), Some(&rec("carol", 4)));
        assert!(!log.wants_compaction(2));
        // A compaction in the background: a change appended while the records are
        // written aside is in the rewritten log too.
        let aside = log.begin_compaction().expect("compaction");
        assert!(log.begin_compaction().is_none(), "one at a time");
        log.append_all(&[rec("dave", 5)]).expect("append meanwhile");
        let n = Log::write_aside(&aside, [rec("alice", 3), rec("carol", 4)].iter()).expect("aside");
        log.finish_compaction(&aside, n).expect("finish");
        log.append_all(&[rec("bob", 6)]).expect("append");
        let (_, r) = Log::open(&path).expect("after compaction");
        assert_eq!(
            r.records,
            vec![
                rec("alice", 3),
                rec("carol", 4),
                rec("dave", 5),
                rec("bob", 6)
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
