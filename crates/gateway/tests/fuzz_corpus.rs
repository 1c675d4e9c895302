//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`) through the same harness
//! functions the fuzz targets call, so that `cargo test` on stable catches a regression
//! of anything a fuzzer once found or covered. A harness panics when an invariant breaks.

use std::path::{Path, PathBuf};

/// The corpus folder of `target`.
fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

/// Feeds every file of `target`'s corpus to `harness`; names the file that panicked.
fn replay(target: &str, harness: fn(&[u8])) {
    let dir = corpus(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} is empty", dir.display());
    for file in &files {
        let data = std::fs::read(file).expect("a corpus file");
        if std::panic::catch_unwind(|| harness(&data)).is_err() {
            panic!("{target}: {} makes the harness panic", file.display());
        }
    }
}

#[test]
fn otlp_span() {
    replay("otlp_span", tollgate_gateway::fuzz::otlp_span);
}

#[test]
fn hpack() {
    replay("hpack", tollgate_gateway::fuzz::hpack);
}

#[test]
fn h1_framing() {
    replay("h1_framing", tollgate_gateway::fuzz::h1_framing);
}

#[test]
fn h2_frames() {
    replay("h2_frames", tollgate_gateway::fuzz::h2_frames);
}

#[test]
fn upstream_h1() {
    replay("upstream_h1", tollgate_gateway::fuzz::upstream_h1);
}

#[test]
fn path_host() {
    replay("path_host", tollgate_gateway::fuzz::path_host);
}

#[test]
fn cache_control() {
    replay("cache_control", tollgate_gateway::fuzz::cache_control);
}

#[test]
fn consumers_line() {
    replay("consumers_line", tollgate_config::fuzz::consumers_line);
}

#[test]
fn range_query() {
    replay("range_query", tollgate_gateway::fuzz::range_query);
}
