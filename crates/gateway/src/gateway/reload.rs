//! Reloads: a validated config is compiled into a new snapshot and swapped in atomically;
//! a bad file is rejected with every problem, and the old config keeps serving.

use super::state::Gateway;
use crate::observe::access_log::AccessLog;
use crate::snapshot::Snapshot;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tollgate_config::{fingerprint, Config, ConfigError, Problem};

impl Gateway {
    /// with; counters of unchanged limits and pools of unchanged upstreams carry over.
    pub fn apply(&self, config: Config) {
        let old = self.snapshot.load();
        let same_sockets = old.config.listeners.len() == config.listeners.len()
            && old
                .config
                .listeners
                .iter()
                .zip(&config.listeners)
                .all(|(a, b)| a.same_socket(b));
        if !same_sockets {
            tracing::warn!(
                "listener changes (other than TLS certificates) take effect at the next restart"
            );
        }
        if old.config.cache != config.cache {
            tracing::warn!("cache size changes take effect at the next restart");
        }
        if old.config.cluster != config.cluster {
            tracing::warn!("cluster changes take effect at the next restart");
        }
        if old.config.state != config.state {
            tracing::warn!("state changes take effect at the next restart");
        }
        if old.config.analytics != config.analytics {
            tracing::warn!("analytics changes take effect at the next restart");
        }
        if old.config.log_format != config.log_format {
            tracing::warn!("log.format changes take effect at the next restart");
        }
        if old.config.access_log != config.access_log {
            self.access_log.store(
                config
                    .access_log
                    .as_ref()
                    .map(|c| AccessLog::start(c, self.metrics.clone())),
            );
        }
        if old.config.tracing != config.tracing {
            match (&config.tracing, &self.runtime) {
                (Some(t), Some(rt)) => {
                    let new = crate::observe::trace::Spans::start(t, self.metrics.clone(), rt);
                    let running = self.spans.load().as_ref().is_some_and(|s| s.exporting());
                    if new.exporting() || !running {
                        self.spans.store(Some(new));
                    } else {
                        // Why is in the log already (from `start`); the running exporter
                        // stays.
                        tracing::error!(
                            "tracing: the new `tracing:` settings are not applied; the previous ones stay"
                        );
                    }
                }
                _ => self.spans.store(None),
            }
        }
        if old.config.admin != config.admin {
            tracing::warn!(
                "admin changes (address, token, limits) take effect at the next restart"
            );
        }
        let snapshot = Snapshot::build(config, &self.registry);
        // Counts the old table kept in its slots move to cells, where the new one finds
        // them.
        old.counters.settle_all(self.now());
        self.snapshot.store(Arc::new(snapshot));
        self.metrics.reloads.inc();
        self.status.send_modify(|s| {
            s.generation += 1;
            s.last_error = None;
        });
    }

    /// Records the content the running config was read from, so the same content is
    /// never applied again.
    pub fn loaded_from(&self, bytes: &[u8]) {
        self.running.store(fingerprint(bytes), Ordering::Relaxed);
        *self.running_text.lock() = Some(Arc::from(bytes));
    }

    /// Records the file the config came from, for `POST /reload`.
    pub fn set_source(&self, path: &Path) {
        *self.source.lock() = Some(path.to_path_buf());
    }

    /// The fingerprint of the content the running config was read from (0 when unknown).
    pub fn running_fingerprint(&self) -> u64 {
        self.running.load(Ordering::Relaxed)
    }

    /// Reads, validates and applies a config file (`SIGHUP`). A bad file is rejected with
    /// every problem logged, and the old config keeps serving; the content already running
    /// is not applied again.
    pub fn reload_file(&self, path: &Path) -> Result<(), ConfigError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            // A file gone or unreadable is a rejected reload like any other: logged,
            // counted and shown in `/status`, the old config serving on.
            Err(e) => {
                let e = ConfigError::Read {
                    path: path.display().to_string(),
                    source: e,
                };
                return Err(self.rejected_with(path, &[], e));
            }
        };
        // A table full of callers by token is renewed by any reload (their counts are
        // kept by name): the one thing an unchanged file still applies.
        let full = self.snapshot().counters.full_of_tokens();
        if fingerprint(&bytes) == self.running_fingerprint()
            && !self.consumers_file_changed()
            && !self.tls_files_changed()
            && !full
        {
            tracing::info!(path = %path.display(), "config unchanged; nothing to reload");
            // The file is the running config again: an error of a bad version since
            // mended no longer describes it.
            self.rejected.store(0, Ordering::Relaxed);
            self.status
                .send_if_modified(|s| s.last_error.take().is_some());
            return Ok(());
        }
        if full {
            tracing::info!(path = %path.display(), "reloading to start a new table of callers by token (the last one was full)");
        }
        self.reload_bytes(path, &bytes)
    }

    /// Whether the running config's consumers file now holds other content than it was
    /// loaded from (a file that cannot be read counts as changed: the reload reports it).
    pub fn consumers_file_changed(&self) -> bool {
        let snap = self.snapshot.load();
        snap.config.consumers_file.as_ref().is_some_and(|f| {
            tollgate_config::fingerprint_file(&f.path).map_or(true, |fp| fp != f.fingerprint)
        })
    }

    /// Whether a certificate, key or CA file, or a token key file (`jwks_file`,
    /// `secret_file`), the running config names now holds other content than it was
    /// loaded with (renewed certificates, a rotated secret).
    pub fn tls_files_changed(&self) -> bool {
        tollgate_config::tls::files_on_disk(&self.snapshot.load().config).is_some_and(|(_, c)| c)
    }

    /// Validates and applies `bytes`, read from `path` (relative file names in it are
    /// read beside it). Blocking: a config with a large consumers file takes a moment to
    /// load, so async callers run this on a blocking thread.
    pub fn reload_bytes(&self, path: &Path, bytes: &[u8]) -> Result<(), ConfigError> {
        let parsed = std::str::from_utf8(bytes)
            .map_err(|_| {
                ConfigError::invalid(vec![tollgate_config::Problem::new(
                    "",
                    "the file is not UTF-8 text",
                )])
            })
            .and_then(|text| {
                let manages = self.manages_keys || !self.snapshot().roster.is_empty();
                tollgate_config::from_text_for(text, path, manages)
            });
        match parsed {
            Ok(cfg) => {
                for w in &cfg.warnings {
                    tracing::warn!(path = %path.display(), "{w}");
                }
                // A key the new config gives to one consumer and the admin API to
                // another would name two, a plan it drops would leave consumers without
                // their limits: refused. A plan the running config lacks already (a
                // start with it missing, another node's change) is only said again: its
                // consumers are refused (503) either way, and the reload may bring what
                // the node needs (certificates, keys). Checked and swapped in with no
                // change of a consumer in between.
                let snap = self.snapshot();
                if let Some(p) = emptied(&snap.config, &cfg) {
                    return Err(self.rejected_with(path, bytes, ConfigError::invalid(vec![p])));
                }
                let roster = snap.roster.clone();
                let applied = roster.unchanged(|| {
                    let missing = roster.missing_plans(&snap.config);
                    let mut clash = roster.conflicts(&cfg);
                    clash.retain(|p| {
                        let already = missing.contains(p);
                        if already {
                            tracing::warn!("{p}; the consumer is refused (503) until then");
                        }
                        !already
                    });
                    if !clash.is_empty() {
                        return Err(ConfigError::invalid(clash));
                    }
                    // Recorded before the swap, so whoever sees the new generation also
                    // sees its content as running (and does not apply it again).
                    self.loaded_from(bytes);
                    self.rejected.store(0, Ordering::Relaxed);
                    self.apply(cfg);
                    Ok(())
                });
                if let Err(e) = applied {
                    return Err(self.rejected_with(path, bytes, e));
                }
                tracing::info!(path = %path.display(), generation = self.status.borrow().generation, "config reloaded");
                Ok(())
            }
            Err(e) => Err(self.rejected_with(path, bytes, e)),
        }
    }

    /// Records a rejected reload of `bytes` (counted and logged once for the same content
    /// failing the same way) and gives its error back.
    fn rejected_with(&self, path: &Path, bytes: &[u8], e: ConfigError) -> ConfigError {
        let text = e.to_string();
        let fp = fingerprint(bytes);
        // The same content failing the same way (`SIGHUP` after the watcher, or the other
        // way round) is one rejection: counted and logged once. A file it names may have
        // been mended since, so the content is always tried.
        let again = self.rejected.swap(fp, Ordering::Relaxed) == fp
            && self.status.borrow().last_error.as_deref() == Some(text.as_str());
        if again {
            tracing::info!(path = %path.display(), "config rejected again, with the same problems as before; old config keeps serving");
            return e;
        }
        self.metrics.reload_errors.inc();
        for p in e.problems() {
            tracing::error!(path = %path.display(), "config rejected, old config keeps serving: {p}");
        }
        for w in e.warnings() {
            tracing::warn!(path = %path.display(), "{w}");
        }
        self.status.send_modify(|s| s.last_error = Some(text));
        e
    }
}

/// A consumers file that held consumers and holds none now, at the same place: most
/// likely one being rewritten in place (truncated, not yet written), whose consumers
/// would all be refused until it is. Refused; removing `consumers_file` from the config
/// is how every one of them is dropped.
fn emptied(running: &Config, new: &Config) -> Option<Problem> {
    let (old, now) = (
        running.consumers_file.as_ref()?,
        new.consumers_file.as_ref()?,
    );
    (now.consumers == 0 && old.consumers > 0 && now.path == old.path).then(|| {
        Problem::new(
            "consumers_file",
            format!(
                "{} is empty now; it gave {} consumers: the running ones keep serving until it holds some (to drop them all, take `consumers_file` out of the config)",
                now.path.display(),
                old.consumers
            ),
        )
    })
}
