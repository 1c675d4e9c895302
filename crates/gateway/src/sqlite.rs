//! The node-local SQLite files (usage history, limit state): opened one way.

use rusqlite::Connection;
use std::path::Path;
use std::time::Duration;

/// Opens (creating if needed) the database at `path`, applies `schema`, and checks that the
/// file reads back whole (`PRAGMA quick_check`); a file that does not is an error.
pub(crate) fn open(path: &Path, schema: &str) -> rusqlite::Result<Connection> {
    let c = Connection::open(path)?;
    c.busy_timeout(Duration::from_millis(500))?;
    c.execute_batch(schema)?;
    let ok: String = c.query_row("PRAGMA quick_check", [], |r| r.get(0))?;
    if ok != "ok" {
        return Err(rusqlite::Error::InvalidQuery);
    }
    Ok(c)
}
