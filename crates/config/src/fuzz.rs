//! Fuzz harnesses for the config crate's hand-written parsers, one `fn(&[u8])` per target
//! of `fuzz/` (`cargo +nightly fuzz run <target>`), replayed on stable over the committed
//! corpora by the gateway's `tests/fuzz_corpus.rs`. None of this is used by the gateway.

use crate::consumers::Consumers;
use crate::consumers_file;
use std::collections::HashMap;
use std::path::PathBuf;

/// `consumers_line`: the input as a consumers file, read as JSON lines and, under a header
/// line naming every column, as CSV, after one consumer already defined inline (`c0`, key
/// `k0`). Every consumer read must be findable by its name, and a JSON-lines file read
/// without problems must give one consumer per non-blank line.
pub fn consumers_line(data: &[u8]) {
    let dir = std::env::temp_dir();
    let stem = format!(
        "tollgate-fuzz-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    )
    .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "");
    let mut csv = b"name,plan,keys,key_sha256\n".to_vec();
    csv.extend_from_slice(data);
    for (name, bytes) in [
        (format!("{stem}.jsonl"), data),
        (format!("{stem}.csv"), &csv[..]),
    ] {
        let path = dir.join(&name);
        if std::fs::write(&path, bytes).is_err() {
            return;
        }
        read(&name, &dir, bytes);
        let _ = std::fs::remove_file(&path);
    }
}

/// One file read into a table holding `c0`, and what must hold of the result.
fn read(name: &str, dir: &std::path::Path, bytes: &[u8]) {
    let plans: HashMap<String, usize> = [("gold".to_string(), 0), ("free".to_string(), 1)]
        .into_iter()
        .collect();
    let mut table = Consumers::with_capacity(1, 1);
    if table.push("c0", None, &["k0"], &[]).is_err() {
        panic!("the inline consumer is refused");
    }
    let mut problems = Vec::new();
    let got = consumers_file::load(name, dir, &plans, &mut table, 1, &mut problems);
    let Some((path, fingerprint, _)) = got else {
        panic!("{name} written and not read: {problems:?}");
    };
    assert_eq!(path, PathBuf::from(dir).join(name));
    assert_eq!(fingerprint, crate::fingerprint(bytes));
    assert_eq!(table.find("c0"), Some(0));
    for i in 0..table.len() {
        let n = table.name(i);
        assert!(consumers_file::valid_token(n), "consumer {i} named {n:?}");
        assert_eq!(table.find(n), Some(i), "{n:?}");
        assert!(table.plan(i).is_none_or(|p| p < 2));
    }
    assert!(problems.len() <= 101, "{} problems", problems.len());
    for p in &problems {
        assert!(p.path.starts_with(name), "a problem placed at {:?}", p.path);
    }
    if name.ends_with(".jsonl") && problems.is_empty() {
        let lines = bytes
            .split(|b| *b == b'\n')
            .filter(|l| std::str::from_utf8(l).map_or(true, |t| !t.trim().is_empty()))
            .count();
        assert_eq!(table.len(), 1 + lines, "lines lost without a problem");
    }
}
