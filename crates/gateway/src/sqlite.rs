//! The node-local SQLite files (usage history, limit state): opened one way.

use rusqlite::{Connection, OpenFlags, MAIN_DB};
use std::path::Path;
use std::time::Duration;

/// The tables the gateway's files hold: the limit state's and the usage history's (one
/// file may hold both).
pub(crate) const OURS: &[&str] = &["windows", "usage"];

/// Opens (creating if needed) the database at `path`, applies `schema`, and checks that the
/// file reads back whole (`PRAGMA quick_check`); a file that does not is an error. A
/// database holding tables other than `ours` belongs to something else: it is refused
/// untouched (the schema is not added to it). A file SQLite could open for reading only
/// (write-protected) is an error too: nothing could be written to it.
pub(crate) fn open(path: &Path, schema: &str, ours: &[&str]) -> rusqlite::Result<Connection> {
    let c = Connection::open(path)?;
    if c.is_readonly(MAIN_DB)? {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_READONLY),
            Some("the file cannot be written here (write-protected)".into()),
        ));
    }
    c.busy_timeout(Duration::from_millis(500))?;
    let theirs = foreign_tables(&c, ours)?;
    if !theirs.is_empty() {
        return Err(foreign(&theirs));
    }
    c.execute_batch(schema)?;
    let ok: String = c.query_row("PRAGMA quick_check", [], |r| r.get(0))?;
    if ok != "ok" {
        return Err(damaged(&ok));
    }
    Ok(c)
}

/// Opens the database at `path` for reading only: for a file whose folder or disk may
/// not be written. Where SQLite cannot make the shared-memory file a WAL database needs,
/// the file is read as immutable, which ignores its write-ahead log: only when that log
/// is empty or gone (a clean stop), since its frames are the newest counts.
pub(crate) fn open_read_only(path: &Path) -> rusqlite::Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let readable = |c: Connection| {
        // Opening is lazy: the first read says whether the file can be read here.
        c.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
        Ok(c)
    };
    let plain = Connection::open_with_flags(path, flags).and_then(readable);
    let e = match plain {
        Ok(c) => return Ok(c),
        Err(e) => e,
    };
    let wal = std::path::PathBuf::from(format!("{}-wal", path.display()));
    if std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0) {
        return Err(e);
    }
    let abs = std::path::absolute(path).map_err(|_| rusqlite::Error::InvalidPath(path.into()))?;
    let url =
        url::Url::from_file_path(&abs).map_err(|()| rusqlite::Error::InvalidPath(abs.clone()))?;
    Connection::open_with_flags(
        format!("{url}?immutable=1"),
        flags | OpenFlags::SQLITE_OPEN_URI,
    )
    .and_then(readable)
}

/// The tables in `c` that are not `ours` (SQLite's own left out).
fn foreign_tables(c: &Connection, ours: &[&str]) -> rusqlite::Result<Vec<String>> {
    let mut stmt = c.prepare(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name",
    )?;
    let names = stmt.query_map([], |r| r.get::<_, String>(0))?;
    let mut out = Vec::new();
    for name in names {
        let name = name?;
        if !ours.contains(&name.as_str()) {
            out.push(name);
        }
    }
    Ok(out)
}

/// The error of a database that holds another program's tables.
fn foreign(tables: &[String]) -> rusqlite::Error {
    let shown: Vec<&str> = tables.iter().take(5).map(String::as_str).collect();
    rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_MISMATCH),
        Some(format!(
            "a database of something else (its tables: {}); left untouched: name another file",
            shown.join(", ")
        )),
    )
}

/// The error of a file `PRAGMA quick_check` found damaged (`said` is its first finding).
fn damaged(said: &str) -> rusqlite::Error {
    rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
        Some(format!("the file is damaged (quick_check: {said})")),
    )
}

/// Whether `e` is [`open`]'s refusal of another program's database.
pub(crate) fn is_foreign(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.extended_code == rusqlite::ffi::SQLITE_MISMATCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS rows (k INTEGER PRIMARY KEY, v BLOB);";

    fn folder(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tollgate-sqlite-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

    #[test]
    fn a_torn_file_is_called_damaged_and_another_programs_is_left_alone() {
        let dir = folder("open");
        let torn = dir.join("torn.db");
        {
            let c = open(&torn, SCHEMA, &["rows"]).expect("open");
            c.execute_batch(
                "WITH RECURSIVE n(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM n WHERE k < 1999)
                 INSERT INTO rows SELECT k, zeroblob(100) FROM n;",
            )
            .expect("rows");
        }
        // Pages past the schema's overwritten, as a torn write leaves them: the file
        // opens, and its check finds the damage.
        let len = std::fs::metadata(&torn).expect("meta").len();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&torn)
            .expect("open");
        use std::io::{Seek, Write};
        f.seek(std::io::SeekFrom::Start(len / 2)).expect("seek");
        f.write_all(&vec![0x5a; 8192]).expect("tear");
        drop(f);
        let e = open(&torn, SCHEMA, &["rows"]).expect_err("a torn file");
        let said = e.to_string();
        assert!(
            matches!(&e, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DatabaseCorrupt)
                && said.contains("the file is damaged (quick_check: "),
            "{said}"
        );

        let theirs = dir.join("theirs.db");
        Connection::open(&theirs)
            .and_then(|c| c.execute_batch("CREATE TABLE accounts (id INTEGER);"))
            .expect("theirs");
        let before = std::fs::read(&theirs).expect("read");
        let e = open(&theirs, SCHEMA, &["rows"]).expect_err("another program's");
        assert!(is_foreign(&e), "{e}");
        assert!(e.to_string().contains("its tables: accounts"), "{e}");
        assert_eq!(std::fs::read(&theirs).expect("read"), before);
        // One file may hold both of ours: the limit state's and the usage history's.
        let both = dir.join("both.db");
        open(&both, "CREATE TABLE IF NOT EXISTS windows (k TEXT);", OURS).expect("state");
        open(&both, "CREATE TABLE IF NOT EXISTS usage (k TEXT);", OURS).expect("history");
        open(&both, "CREATE TABLE IF NOT EXISTS windows (k TEXT);", OURS).expect("state again");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
