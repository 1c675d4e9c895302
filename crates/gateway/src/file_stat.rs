//! What a look at a file's metadata tells one state of it from another: device, inode,
//! length and the time of its last change. The config watcher and the consumer change log
//! both tell a file changed by another hand this way.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A file's identity, size and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileStat {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
}

impl FileStat {
    /// The state `m` describes.
    pub(crate) fn of(m: &std::fs::Metadata) -> FileStat {
        FileStat {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
        }
    }

    /// The state of the file `path` names now, if any.
    pub(crate) fn at(path: &Path) -> Option<FileStat> {
        std::fs::metadata(path).ok().map(|m| FileStat::of(&m))
    }

    /// Which file: device and inode.
    pub(crate) fn file(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }
}
