//! The change log: one JSON line per change, appended and synced before the change is
//! answered, replayed at start (the last line of a name wins). When it holds more than
//! twice the live records it is rewritten with one line each (written aside, synced,
//! renamed over), so a change costs one line however many consumers there are.
//!
//! As Redis reads its append-only file: a torn last line (a crash mid-write) is skipped,
//! and cut off before the next line is written, so it never ends up inside the log; any
//! other line that is not a record stops the replay. Skipping it could bring back a
//! consumer or a key it deleted.

use super::record::Managed;
use crate::file_lock::FileLock;
use crate::file_stat::FileStat;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What a second gateway naming the same log is told.
const BUSY: &str =
    "two gateways writing one log would undo each other's changes: give each its own consumers_log";

/// Lines a log may hold beyond twice its live records before it is compacted.
const SLACK: u64 = 1024;

/// An open change log.
#[derive(Debug)]
pub struct Log {
    path: PathBuf,
    /// Opened (and the file made) by the first change.
    file: Option<File>,
    lines: u64,
    /// The file ends without a newline: where to cut it before the next line (a torn
    /// last line is dropped; a whole record that only lacks its newline is kept).
    torn: Option<u64>,
    /// The file as the log last read or wrote it: a change finding another file at the
    /// path, or none, or this one changed by another hand, writes the log whole again.
    identity: Option<FileStat>,
    /// While a compaction runs: the records appended since it began.
    compacting: Option<Vec<Managed>>,
    /// This process's hold on the log (none while its folder does not exist).
    lock: Option<FileLock>,
}

/// What a log held when it was opened.
#[derive(Debug, Default)]
pub struct Replayed {
    /// Every record, in file order.
    pub records: Vec<Managed>,
    /// The torn last line skipped (a crash mid-write), by line number.
    pub skipped: Vec<usize>,
    /// The file did not exist yet (the first change makes it).
    pub missing: bool,
}

/// The highest version a log may hold: 10^13 ms (the year 2286), times 1024. One near
/// `u64::MAX` would freeze its consumer (no later change could win over it); the clock is
/// not the bound, so that a machine that starts with its clock behind still reads its log.
const MAX_VERSION: u64 = 10_000_000_000_000 << 10;

/// A record as the admin API writes it: a valid name, keys as 64 hex digits, a version
/// below [`MAX_VERSION`].
fn check(r: &Managed) -> Result<(), String> {
    if !super::record::valid_name(&r.name) {
        return Err(format!("{:?} is not a consumer name", r.name));
    }
    if let Some(k) = r
        .keys
        .iter()
        .find(|k| super::record::parse_digest(&k.sha256).is_none())
    {
        return Err(format!("key {:?} is not a SHA-256 digest", k.id));
    }
    if r.version > MAX_VERSION {
        return Err(format!(
            "version {} is past the year 2286 (versions are milliseconds times 1024)",
            r.version
        ));
    }
    Ok(())
}

impl Log {
    /// Opens the log at `path` (made by the first change) and reads what it holds. A torn
    /// last line (one that is not JSON and lacks its newline) is skipped and named; any
    /// other line that is not a valid record, or a log that cannot be read, is an error
    /// naming the line. Another process keeping the same log is an error too.
    pub fn open(path: &Path) -> std::io::Result<(Log, Replayed)> {
        // Not a FIFO or a device (before the lock, which would open it): reading one would
        // wait for a writer, or never end.
        regular(path)?;
        let lock = FileLock::take(path, "this log", BUSY)?;
        let (replayed, lines, torn) = read(path)?;
        Ok((
            Log {
                path: path.to_path_buf(),
                file: None,
                lines,
                torn,
                identity: FileStat::at(path),
                compacting: None,
                lock,
            },
            replayed,
        ))
    }

    /// Whether the path names the file as this log left it.
    fn still_ours(&self, file: &File) -> bool {
        let mine = file.metadata().ok().map(|m| FileStat::of(&m));
        mine.is_some() && FileStat::at(&self.path) == mine
    }

    /// Writes `live` as the whole log (aside, synced, renamed over the path): the log
    /// after its file was removed or replaced.
    pub fn rewrite<'a>(&mut self, live: impl Iterator<Item = &'a Managed>) -> std::io::Result<()> {
        let aside = self.path.with_extension("rewriting");
        let written = Log::write_aside(&aside, live)?;
        // Opened, and its state taken, before it is renamed: the handle is the file
        // written, and a hand that changes it once it is at the path (emptied while the
        // folder is synced, say) is told by the next change.
        let file = OpenOptions::new().append(true).open(&aside)?;
        let identity = FileStat::of(&file.metadata()?);
        std::fs::rename(&aside, &self.path)?;
        sync_dir(&self.path);
        self.identity = Some(identity);
        self.file = Some(file);
        self.lines = written;
        self.torn = None;
        Ok(())
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends records and syncs them to disk, once for all. Returns whether the file
    /// was as this log left it throughout: `false` when another hand changed it (removed,
    /// emptied, written to) between the last change and this one's end, and what it holds
    /// must be written whole again.
    pub fn append_all(&mut self, records: &[Managed]) -> std::io::Result<bool> {
        let mut out = Vec::new();
        for r in records {
            serde_json::to_writer(&mut out, r)?;
            out.push(b'\n');
        }
        if self.lock.is_none() {
            // The folder did not exist at start: whoever makes the file first keeps it.
            self.lock = FileLock::take(&self.path, "this log", BUSY)?;
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
        let mut before = file.metadata()?;
        let mut clean = self.identity.is_none_or(|id| id == FileStat::of(&before));
        if let Some(cut) = self.torn {
            // A torn line is cut off; a whole record that lacked its newline gets one.
            if cut < before.len() {
                file.set_len(cut)?;
                before = file.metadata()?;
            } else {
                out.insert(0, b'\n');
            }
        }
        file.write_all(&out)?;
        file.sync_data()?;
        self.torn = None;
        if made {
            sync_dir(&self.path);
        }
        let after = file.metadata()?;
        clean &= after.len() == before.len() + out.len() as u64;
        self.identity = Some(FileStat::of(&after));
        let file = self.file.as_ref().map(|f| self.still_ours(f));
        clean &= file == Some(true);
        self.lines += records.len() as u64;
        if let Some(since) = &mut self.compacting {
            since.extend(records.iter().cloned());
        }
        Ok(clean)
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
        // Its state taken before it is renamed, as in `rewrite`.
        let identity = FileStat::of(&f.metadata()?);
        std::fs::rename(aside, &self.path)?;
        sync_dir(&self.path);
        self.identity = Some(identity);
        self.file = Some(f);
        self.lines = written + since.len() as u64;
        self.torn = None;
        Ok(())
    }

    /// Gives a compaction up: the log stays as it is.
    pub fn abandon_compaction(&mut self, aside: &Path) {
        self.compacting = None;
        let _ = std::fs::remove_file(aside);
    }
}

/// What the log at `path` holds, read without taking it (`tollgate check` reads the log of
/// a running gateway): the records, the count of lines read and where a torn last line
/// starts. The errors are those of [`Log::open`].
pub fn read(path: &Path) -> std::io::Result<(Replayed, u64, Option<u64>)> {
    regular(path)?;
    let mut replayed = Replayed::default();
    let mut lines = 0;
    let mut torn = None;
    let damaged = |line: usize, why: String| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "line {line} is not a consumer change ({why}); only a torn last line is skipped, since a change lost could bring back a consumer or key it deleted: mend or remove the line"
            ),
        )
    };
    match std::fs::read(path) {
        Ok(bytes) => {
            let ends_whole = bytes.last().is_none_or(|b| *b == b'\n');
            let last_start = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
            if !ends_whole {
                torn = Some(bytes.len() as u64);
            }
            let count = bytes.split(|b| *b == b'\n').count();
            for (i, line) in bytes.split(|b| *b == b'\n').enumerate() {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let is_torn = !ends_whole && i + 1 == count;
                match serde_json::from_slice::<Managed>(line) {
                    Ok(r) => {
                        check(&r).map_err(|why| damaged(i + 1, why))?;
                        lines += 1;
                        replayed.records.push(r);
                    }
                    Err(_) if is_torn => {
                        replayed.skipped.push(i + 1);
                        torn = Some(last_start as u64);
                    }
                    Err(e) => return Err(damaged(i + 1, e.to_string())),
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => replayed.missing = true,
        Err(e) => return Err(e),
    }
    Ok((replayed, lines, torn))
}

/// Refuses a path that is there but no regular file (a FIFO, a device, a folder).
fn regular(path: &Path) -> std::io::Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "it is not a regular file",
        )),
        _ => Ok(()),
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
        /// Whatever a crash leaves at the end, every whole record is read back, in
        /// order, and nothing else is taken for one; a line that is not a record anywhere
        /// else stops the replay.
        #[test]
        fn replay_reads_every_record_and_refuses_what_is_not_one(
            lines in prop::collection::vec(
                prop_oneof![
                    (0u64..1_000_000).prop_map(Ok),
                    prop::collection::vec(any::<u8>(), 0..40).prop_map(Err),
                ],
                0..30,
            ),
            tail in prop::collection::vec(any::<u8>(), 0..40),
        ) {
            let dir = std::env::temp_dir().join(format!("tollgate-log-prop-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("dir");
            let path = dir.join("p.changes");
            let mut bytes = Vec::new();
            let mut want = Vec::new();
            let mut damaged = None;
            for (i, l) in lines.iter().enumerate() {
                match l {
                    Ok(v) => {
                        let r = rec(&format!("c{v}"), *v);
                        bytes.extend(serde_json::to_vec(&r).expect("json"));
                        want.push(r);
                    }
                    Err(junk) => {
                        let junk: Vec<u8> = junk.iter().copied().filter(|b| *b != b'\n').collect();
                        if damaged.is_none() && !junk.iter().all(u8::is_ascii_whitespace) {
                            damaged = Some(i + 1);
                        }
                        bytes.extend(junk);
                    }
                }
                bytes.push(b'\n');
            }
            // A torn last line: bytes without their newline.
            bytes.extend(tail.iter().filter(|b| **b != b'\n'));
            std::fs::write(&path, &bytes).expect("write");
            match (Log::open(&path), damaged) {
                // Random bytes are never a record's JSON (an object with a name and a
                // version): what is read is exactly the records, in order.
                (Ok((_, got)), None) => prop_assert_eq!(got.records, want),
                (Err(e), Some(line)) => prop_assert!(
                    e.to_string().starts_with(&format!("line {line} ")),
                    "{}", e
                ),
                (Ok(_), Some(line)) => prop_assert!(false, "line {} was skipped", line),
                (Err(e), None) => prop_assert!(false, "refused: {}", e),
            }
        }
    }

    fn rec(name: &str, version: u64) -> Managed {
        Managed {
            name: name.into(),
            plan: None,
            keys: vec![],
            metadata: Default::default(),
            deleted: false,
            without_config_keys: false,
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
        // The torn line is cut off before the next one is written: it never ends up
        // inside the log, where it would stop the replay.
        log.append_all(&[rec("carol", 4)]).expect("append");
        let (mut log, r) = Log::open(&path).expect("again");
        assert_eq!(r.records.last(), Some(&rec("carol", 4)));
        assert_eq!(r.records.len(), 4);
        assert!(r.skipped.is_empty());
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

    #[test]
    fn a_damaged_line_inside_the_log_or_a_record_out_of_bounds_stops_the_replay() {
        let dir = std::env::temp_dir().join(format!("tollgate-log-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("c.changes");
        let line = |r: &Managed| serde_json::to_string(r).expect("json");
        let cases = [
            // A deletion lost in the middle would bring the consumer back.
            (
                format!(
                    "{}\n{{\"name\":\"ali\n{}\n",
                    line(&rec("a", 1)),
                    line(&rec("a", 3))
                ),
                2,
                "not a consumer change",
            ),
            (
                format!("{}\n", line(&rec("a", u64::MAX))),
                1,
                "past the year 2286",
            ),
            // A whole record that lacks only its newline is no torn line: checked too.
            (
                format!("{}\n{}", line(&rec("a", 1)), line(&rec("a b", 2))),
                2,
                "not a consumer name",
            ),
            (
                format!("{}\n", line(&rec("a b", 1))),
                1,
                "not a consumer name",
            ),
            (
                format!(
                    "{}\n",
                    line(&Managed {
                        keys: vec![super::super::record::ManagedKey {
                            id: "k".into(),
                            sha256: "zz".into(),
                            created: 0
                        }],
                        ..rec("a", 1)
                    })
                ),
                1,
                "not a SHA-256",
            ),
        ];
        for (text, at, why) in cases {
            std::fs::write(&path, &text).expect("write");
            let e = Log::open(&path).expect_err(&text);
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
            let said = e.to_string();
            assert!(
                said.starts_with(&format!("line {at} ")) && said.contains(why),
                "{said}"
            );
        }
        // A whole record that only lacks its newline is kept, and the next line is
        // written after it.
        std::fs::write(&path, line(&rec("a", 1))).expect("write");
        let (mut log, r) = Log::open(&path).expect("open");
        assert_eq!(r.records, vec![rec("a", 1)]);
        log.append_all(&[rec("b", 2)]).expect("append");
        let (_, r) = Log::open(&path).expect("reopen");
        assert_eq!(r.records, vec![rec("a", 1), rec("b", 2)]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
