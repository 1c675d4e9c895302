//! Reload when the config file changes. The file is looked at every `every`; a change is
//! applied only once the content has stayed the same for `settle` (an editor may pause in
//! the middle of writing), or at once when a new file took the old one's place (written
//! elsewhere and renamed, the safe way to update). Content the gateway already runs on —
//! applied here or by `SIGHUP` — is never applied twice: one change, one reload. With
//! `server.watch_config: false` in the running config, the file is not looked at.
//!
//! The running config's `consumers_file` is watched the same way; a change there reloads
//! the config file (which reads both). So are its TLS certificate, key and CA files, and
//! its routes' `jwks_file` and `secret_file`: when their content changes (a renewal, a
//! rotated key), the config is reloaded once for that content.
//! Reloads run on a blocking thread, so traffic goes on on the old config while a large
//! consumers file loads.

use crate::file_stat::FileStat;
use crate::gateway::{fingerprint, Gateway};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Decides when a changed file is whole enough to apply.
#[derive(Debug)]
pub struct Settle {
    settle: Duration,
    /// The file (device, inode) last seen.
    file: Option<(u64, u64)>,
    /// Content seen changed, and since when it has stayed so.
    pending: Option<(u64, Instant)>,
    /// The content last handed out to apply: a rejected file is not tried again until it
    /// changes.
    tried: Option<u64>,
}

impl Settle {
    /// Applies a change after it stayed unchanged for `settle`.
    pub fn new(settle: Duration) -> Settle {
        Settle {
            settle,
            file: None,
            pending: None,
            tried: None,
        }
    }

    /// One look at the file: its identity and content fingerprint at `now`, and the
    /// fingerprint of the content running. Returns whether to apply the content now.
    pub fn observe(&mut self, file: (u64, u64), content: u64, running: u64, now: Instant) -> bool {
        let replaced = self.file.is_some_and(|f| f != file);
        self.file = Some(file);
        if content == running {
            self.pending = None;
            // Back to the running content: a version refused before, written again
            // later, is tried again.
            self.tried = None;
            return false;
        }
        if self.tried == Some(content) {
            self.pending = None;
            return false;
        }
        if replaced {
            self.pending = None;
            self.tried = Some(content);
            return true;
        }
        match self.pending {
            Some((fp, since)) if fp == content => {
                if now.duration_since(since) >= self.settle {
                    self.pending = None;
                    self.tried = Some(content);
                    return true;
                }
                false
            }
            _ => {
                self.pending = Some((content, now));
                false
            }
        }
    }
}

/// One watched file: what was last seen of it, and whether its change has settled.
struct Watched {
    settle: Settle,
    last: Option<(FileStat, u64)>,
}

impl Watched {
    fn new(settle: Duration) -> Watched {
        Watched {
            settle: Settle::new(settle),
            last: None,
        }
    }

    /// One look at `path`: `Some(bytes)` when a change against `running` has settled
    /// (`Some(None)` unless `keep` asks for the content: a consumers file is fingerprinted
    /// in pieces, never held whole). The content is read only when the file's metadata
    /// moved; otherwise its last fingerprint stands, and the settle time runs on.
    async fn look(&mut self, path: &PathBuf, running: u64, keep: bool) -> Option<Option<Vec<u8>>> {
        let meta = tokio::fs::metadata(path).await.ok()?;
        let stat = FileStat::of(&meta);
        let (fp, bytes) = match self.last {
            Some((s, fp)) if s == stat => (fp, None),
            _ if keep => {
                let b = tokio::fs::read(path).await.ok()?;
                (fingerprint(&b), Some(b))
            }
            _ => {
                let p = path.clone();
                let fp = tokio::task::spawn_blocking(move || tollgate_config::fingerprint_file(&p))
                    .await
                    .ok()?
                    .ok()?;
                (fp, None)
            }
        };
        self.last = Some((stat, fp));
        self.settle
            .observe(stat.file(), fp, running, Instant::now())
            .then_some(bytes)
    }
}

/// Watches `path` (and the running config's consumers file and TLS files) and reloads
/// `gw` when a change has settled. The task ends when aborted.
pub fn watch_file(
    gw: Arc<Gateway>,
    path: PathBuf,
    every: Duration,
    settle: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut config = Watched::new(settle);
        let mut consumers = Watched::new(settle);
        let mut tried_tls: Option<u64> = None;
        let mut mended = false;
        let mut tls_stats: Option<Vec<Option<FileStat>>> = None;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let snap = gw.snapshot();
            if !snap.config.server.watch_config {
                continue;
            }
            let file = snap.config.consumers_file.clone();
            drop(snap);
            let running = gw.running_fingerprint();
            if let Some(read) = config.look(&path, running, true).await {
                tracing::info!(path = %path.display(), "config file changed");
                if reload(&gw, &path, read).await {
                    continue;
                }
            }
            // The file put back to the running config after a refused version: the
            // refusal shown in `/status` is over, as a SIGHUP of it says (once for each
            // return, however that reload ends).
            let back = config.last.is_some_and(|(_, fp)| fp == running);
            if !back {
                mended = false;
            } else if !mended && gw.reload_refused() {
                mended = true;
                let (g, p) = (gw.clone(), path.clone());
                let _ = tokio::task::spawn_blocking(move || g.reload_file(&p)).await;
            }
            // Renewed certificates: tried once per content, so that a renewal caught
            // half-written (a new certificate, the old key) is retried when the key lands,
            // not every second in between.
            // Their content is read only when their metadata moved.
            let snap = gw.snapshot();
            let paths = tollgate_config::tls::paths(&snap.config);
            let mut stats = Vec::with_capacity(paths.len());
            for p in paths {
                stats.push(tokio::fs::metadata(p).await.ok().map(|m| FileStat::of(&m)));
            }
            let tls = if tls_stats.as_ref() == Some(&stats) {
                None
            } else {
                tls_stats = Some(stats);
                tollgate_config::tls::files_on_disk(&snap.config)
            };
            drop(snap);
            if let Some((now, true)) = tls {
                if tried_tls != Some(now) {
                    tried_tls = Some(now);
                    tracing::info!(
                        "a TLS certificate, key or CA file, or a token key file, changed"
                    );
                    if reload(&gw, &path, None).await {
                        continue;
                    }
                }
            }
            let Some(f) = file else { continue };
            if consumers
                .look(&f.path, f.fingerprint, false)
                .await
                .is_some()
            {
                tracing::info!(path = %f.path.display(), "consumers file changed");
                // Known changed: straight to the reload, which reads it once more to load
                // it (`reload_file` would read it a second time to fingerprint it).
                reload(&gw, &path, None).await;
            }
        }
    })
}

/// Reloads the config at `path` (its content `bytes` if already read) on a blocking
/// thread, so that traffic goes on while a large consumers file loads. Whether the file
/// could be read.
async fn reload(gw: &Arc<Gateway>, path: &Path, bytes: Option<Vec<u8>>) -> bool {
    let bytes = match bytes {
        Some(b) => b,
        None => match tokio::fs::read(path).await {
            Ok(b) => b,
            Err(_) => return false,
        },
    };
    let (g, p) = (gw.clone(), path.to_path_buf());
    let _ = tokio::task::spawn_blocking(move || g.reload_bytes(&p, &bytes)).await;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_applies_once_it_has_settled_or_at_once_when_renamed_in() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut s = Settle::new(Duration::from_secs(1));
        let inode = (1, 10);
        assert!(!s.observe(inode, 7, 7, ms(0)), "unchanged");
        // Half a file, then the rest 400 ms later: applied 1 s after the last change.
        assert!(!s.observe(inode, 8, 7, ms(250)));
        assert!(!s.observe(inode, 9, 7, ms(650)));
        assert!(!s.observe(inode, 9, 7, ms(1500)));
        assert!(s.observe(inode, 9, 7, ms(1650)));
        assert!(!s.observe(inode, 9, 9, ms(1900)), "applied once");
        // A file renamed into place: at once.
        assert!(s.observe((1, 11), 12, 9, ms(2000)));
        // The content SIGHUP already applied: nothing to do.
        assert!(!s.observe((1, 11), 13, 13, ms(2250)));
        // Content that was rejected is not tried again until it changes.
        assert!(s.observe((1, 12), 14, 13, ms(2500)));
        assert!(!s.observe((1, 12), 14, 13, ms(4000)));
        assert!(!s.observe((1, 12), 15, 13, ms(4100)));
        assert!(s.observe((1, 12), 15, 13, ms(5200)));
        // Refused too; the running content put back, then the refused content written
        // again: tried again.
        assert!(!s.observe((1, 13), 13, 13, ms(5300)));
        assert!(s.observe((1, 14), 15, 13, ms(5500)));
    }
}
