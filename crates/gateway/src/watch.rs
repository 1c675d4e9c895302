//! Reload when the config file changes: its size, modification time and content are
//! checked at a fixed interval (robust to editors that replace the file by renaming).

use crate::gateway::Gateway;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

fn fingerprint(bytes: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// Watches `path` every `every` and reloads `gw` when its content differs from the last
/// content seen, starting with `loaded` (what the running config was read from, so no
/// change made between loading and watching is missed). The task ends when aborted.
pub fn watch_file(
    gw: Arc<Gateway>,
    path: PathBuf,
    loaded: &[u8],
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    let mut last = Some(fingerprint(loaded));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Ok(bytes) = tokio::fs::read(&path).await else {
                continue;
            };
            let now = Some(fingerprint(&bytes));
            if now != last {
                last = now;
                tracing::info!(path = %path.display(), "config file changed");
                let _ = gw.reload_file(&path);
            }
        }
    })
}
