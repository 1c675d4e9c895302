//! `consumers_file:`: consumers kept apart from the YAML, one per line, for lists too long
//! to write inline. Two formats, told apart by the file's extension:
//!
//! - **JSON lines** (any name but `*.csv`): one object a line, blank lines skipped:
//!   `{"name": "c1", "plan": "gold", "keys": ["k1"], "key_sha256": ["<64 hex>"]}`
//! - **CSV** (`*.csv`): a header line naming the columns (`name`, `plan`, `keys`,
//!   `key_sha256`, in any order; `name` required), then one consumer a row. Several keys in
//!   one field are separated by spaces (keys never contain one).
//!
//! Every consumer needs a name and at least one key, plain or hashed. Each problem is
//! reported with its line (`consumers.csv:17: unknown plan "gld"`).

use crate::consumers::{Conflict, Consumers, KeyDigest};
use crate::error::Problem;
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{BufRead, Read, Seek};
use std::path::Path;

/// Most problems reported from one file; the rest are counted.
const MAX_PROBLEMS: usize = 100;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(borrow, default)]
    plan: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    keys: Vec<Cow<'a, str>>,
    #[serde(borrow, default)]
    key_sha256: Vec<Cow<'a, str>>,
}

/// What is wrong with a JSON line that is not a consumer, in the line's own terms: the
/// field at fault where the line is JSON (read again only for a line that failed).
fn line_problem(text: &str, e: &serde_json::Error) -> String {
    const EXAMPLE: &str = r#"a line is {"name": "alice", "keys": ["KEY"], "plan": "gold"}"#;
    let kind = |v: &serde_json::Value| match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "true or false",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    };
    let why = match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(fields)) => {
            let strings = |v: &serde_json::Value| {
                v.as_array()
                    .is_some_and(|l| l.iter().all(serde_json::Value::is_string))
            };
            let wrong = fields.iter().find_map(|(k, v)| {
                let want = match k.as_str() {
                    "name" if !v.is_string() => "a string",
                    "plan" if !(v.is_string() || v.is_null()) => "a string (a plan's name)",
                    "keys" | "key_sha256" if !strings(v) => "a list of strings",
                    "name" | "plan" | "keys" | "key_sha256" => return None,
                    _ => {
                        return Some(format!(
                            "unknown field {k:?}; expected name, plan, keys, key_sha256"
                        ))
                    }
                };
                Some(format!("{k} must be {want}, not {}", kind(v)))
            });
            match wrong {
                Some(w) => w,
                None if !fields.contains_key("name") => "the name is missing".to_string(),
                None => serde_message(e),
            }
        }
        Ok(other) => format!("a JSON object is expected, not {}", kind(&other)),
        Err(_) => format!("not JSON: {} at column {}", serde_message(e), e.column()),
    };
    format!("not a consumer object ({why}); {EXAMPLE}")
}

/// serde_json's message without its place (it counts lines within the one line it read).
fn serde_message(e: &serde_json::Error) -> String {
    let why = e.to_string();
    why.split(" at line ").next().unwrap_or(&why).to_string()
}

/// Collects a file's problems, capped.
pub(crate) struct FileProblems<'p> {
    file: String,
    out: &'p mut Vec<Problem>,
    count: usize,
}

impl FileProblems<'_> {
    fn add(&mut self, line: usize, msg: impl Into<String>) {
        self.count += 1;
        if self.count <= MAX_PROBLEMS {
            self.out
                .push(Problem::new(format!("{}:{line}", self.file), msg));
        }
    }

    fn finish(self) {
        if self.count > MAX_PROBLEMS {
            self.out.push(Problem::new(
                self.file.clone(),
                format!("{} more problems not listed", self.count - MAX_PROBLEMS),
            ));
        }
    }
}

/// What a key field must be: printable ASCII, no spaces (it is compared as sent).
/// Why `-` is no consumer's name.
pub(crate) const NO_CONSUMER_TAKEN: &str =
    "`-` stands for requests without a consumer in the usage history and the access log; choose another name";

pub(crate) fn valid_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| (0x21..0x7f).contains(&b))
}

/// `<64 hex digits>` (surrounding spaces ignored) → digest.
pub fn parse_digest(s: &str) -> Option<KeyDigest> {
    let s = s.trim();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in s.as_bytes().chunks(2).enumerate() {
        let hex = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(hex, 16).ok()?;
    }
    Some(out)
}

/// One consumer as read, checked and added to `table`; `names_from` tells where a clashing
/// consumer was defined.
#[allow(clippy::too_many_arguments)]
fn add(
    table: &mut Consumers,
    plans: &HashMap<String, usize>,
    name: &str,
    plan: Option<&str>,
    keys: &[&str],
    hashed: &[&str],
    line: usize,
    probs: &mut FileProblems<'_>,
    place_of: &dyn Fn(usize) -> String,
) {
    let before = probs.count;
    if !valid_token(name) {
        probs.add(
            line,
            "name must be non-empty printable ASCII without spaces (it is sent upstream in a header)",
        );
    } else if name == crate::NO_CONSUMER {
        probs.add(line, NO_CONSUMER_TAKEN);
    }
    let plan = match plan {
        None => None,
        Some(p) => match plans.get(p) {
            Some(&ix) => Some(ix),
            None => {
                probs.add(line, format!("unknown plan {p:?}"));
                None
            }
        },
    };
    if keys.is_empty() && hashed.is_empty() {
        probs.add(
            line,
            "at least one key is required (`keys` or `key_sha256`)",
        );
    }
    if keys.iter().any(|k| !valid_token(k)) {
        probs.add(
            line,
            "keys must be non-empty printable ASCII without spaces",
        );
    }
    let mut digests = Vec::with_capacity(hashed.len());
    for h in hashed {
        match parse_digest(h) {
            Some(d) => digests.push(d),
            None => probs.add(
                line,
                format!("key_sha256 {h:?} must be 64 hex digits (the SHA-256 of the key)"),
            ),
        }
    }
    if probs.count > before {
        return;
    }
    match table.push(name, plan, keys, &digests) {
        Ok(_) => {}
        Err(Conflict::Name(other)) => probs.add(
            line,
            format!(
                "consumer {name:?} is already defined at {}",
                place_of(other)
            ),
        ),
        Err(Conflict::Key { other, .. }) => probs.add(
            line,
            format!("a key of {name:?} is already used by {}", place_of(other)),
        ),
        Err(Conflict::TooLarge) => probs.add(line, "too many consumers or keys (4 GiB in all)"),
    }
}

/// Reads the consumers in `path` (relative to `base`) into `table`, after the `inline` ones
/// already there. Returns the file's path, the fingerprint of its content and the line of
/// each consumer taken from it (in table order, after the inline ones).
pub(crate) fn load(
    file_name: &str,
    base: &Path,
    plans: &HashMap<String, usize>,
    table: &mut Consumers,
    inline: usize,
    out: &mut Vec<Problem>,
) -> Option<(std::path::PathBuf, u64, Vec<u32>)> {
    let path = base.join(file_name);
    let cannot_read = |out: &mut Vec<Problem>, e: std::io::Error| {
        out.push(Problem::new(
            "consumers_file",
            format!("cannot read {}: {e}", path.display()),
        ));
    };
    // Read in pieces, never whole: a million consumers make a file of tens of megabytes,
    // which a reload would otherwise hold beside both the running table and the new one.
    // A first pass counts the lines, so that the table is sized once.
    let mut file = match std::fs::File::open(&path).and_then(|mut f| {
        let lines = count_lines(&mut f)?;
        Ok((f, lines))
    }) {
        Ok((f, lines)) => {
            table.reserve(lines + 1);
            std::io::BufReader::with_capacity(64 * 1024, f)
        }
        Err(e) => {
            cannot_read(out, e);
            return None;
        }
    };
    let mut fingerprint = crate::Fingerprint::default();
    let mut probs = FileProblems {
        file: file_name.to_string(),
        out,
        count: 0,
    };
    // Lines are counted in the file, so a consumer's place is known from its index once
    // the inline ones are taken off.
    let mut lines: Vec<u32> = Vec::new();
    let place_of = |lines: &Vec<u32>, other: usize| -> String {
        if other < inline {
            format!("consumers[{other}] in the config file")
        } else {
            match lines.get(other - inline) {
                Some(l) => format!("{file_name}:{l}"),
                None => "the same line".to_string(),
            }
        }
    };
    let csv = Path::new(file_name)
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"));
    if csv {
        let mut reader = Fingerprinted {
            inner: file,
            fingerprint: &mut fingerprint,
        };
        load_csv(&mut reader, plans, table, &mut probs, &mut lines, &place_of);
        // What the CSV reader left unread (after a problem) is part of the content too.
        if let Err(e) = std::io::copy(&mut reader, &mut std::io::sink()) {
            cannot_read(probs.out, e);
            return None;
        }
    } else {
        let mut raw = Vec::new();
        let mut line = 0;
        loop {
            raw.clear();
            match file.read_until(b'\n', &mut raw) {
                Ok(0) => break,
                Ok(_) => fingerprint.add(&raw),
                Err(e) => {
                    cannot_read(probs.out, e);
                    return None;
                }
            }
            line += 1;
            let text = match std::str::from_utf8(raw.strip_suffix(b"\n").unwrap_or(&raw)) {
                Ok(t) => t.trim(),
                Err(_) => {
                    probs.add(line, "not UTF-8 text");
                    continue;
                }
            };
            if text.is_empty() {
                continue;
            }
            let parsed: Line<'_> = match serde_json::from_str(text) {
                Ok(p) => p,
                Err(e) => {
                    probs.add(line, line_problem(text, &e));
                    continue;
                }
            };
            let keys: Vec<&str> = parsed.keys.iter().map(|k| k.as_ref()).collect();
            let hashed: Vec<&str> = parsed.key_sha256.iter().map(|k| k.as_ref()).collect();
            let len = table.len();
            add(
                table,
                plans,
                &parsed.name,
                parsed.plan.as_deref(),
                &keys,
                &hashed,
                line,
                &mut probs,
                &|o| place_of(&lines, o),
            );
            if table.len() > len {
                lines.push(line as u32);
            }
        }
    }
    let fingerprint = fingerprint.finish();
    probs.finish();
    Some((path, fingerprint, lines))
}

/// The lines in `file` (its newlines), read through in pieces; the file is left at its
/// start again.
fn count_lines(file: &mut std::fs::File) -> std::io::Result<usize> {
    let mut lines = 0;
    crate::read_pieces(file, |piece| {
        lines += piece.iter().filter(|&&b| b == b'\n').count();
    })?;
    file.rewind()?;
    Ok(lines)
}

/// A reader that adds what passes through it to a fingerprint.
struct Fingerprinted<'f, R> {
    inner: R,
    fingerprint: &'f mut crate::Fingerprint,
}

impl<R: Read> Read for Fingerprinted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.fingerprint.add(&buf[..n]);
        Ok(n)
    }
}

fn load_csv(
    bytes: &mut dyn Read,
    plans: &HashMap<String, usize>,
    table: &mut Consumers,
    probs: &mut FileProblems<'_>,
    lines: &mut Vec<u32>,
    place_of: &dyn Fn(&Vec<u32>, usize) -> String,
) {
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(false)
        .trim(csv::Trim::All)
        .from_reader(bytes);
    let mut cols = [None::<usize>; 4];
    match rdr.headers() {
        Ok(h) => {
            for (i, name) in h.iter().enumerate() {
                let slot = match name {
                    "name" => 0,
                    "plan" => 1,
                    "keys" => 2,
                    "key_sha256" => 3,
                    other => {
                        probs.add(
                            1,
                            format!(
                                "unknown column {other:?}; expected name, plan, keys, key_sha256"
                            ),
                        );
                        continue;
                    }
                };
                cols[slot] = Some(i);
            }
        }
        Err(e) => {
            probs.add(1, format!("cannot read the header line: {e}"));
            return;
        }
    }
    if cols[0].is_none() {
        probs.add(1, "the header line must name a `name` column");
        return;
    }
    let mut rec = csv::StringRecord::new();
    loop {
        let line = rdr.position().line() as usize;
        match rdr.read_record(&mut rec) {
            Ok(false) => break,
            Ok(true) => {}
            Err(e) => {
                probs.add(line, format!("not a CSV row: {e}"));
                if matches!(e.kind(), csv::ErrorKind::Io(_)) {
                    break;
                }
                continue;
            }
        }
        let line = rec.position().map_or(line, |p| p.line() as usize);
        if rec.iter().all(str::is_empty) {
            continue;
        }
        let field = |c: Option<usize>| c.and_then(|i| rec.get(i)).unwrap_or("");
        let name = field(cols[0]);
        let plan = Some(field(cols[1])).filter(|p| !p.is_empty());
        let keys: Vec<&str> = field(cols[2]).split_ascii_whitespace().collect();
        let hashed: Vec<&str> = field(cols[3]).split_ascii_whitespace().collect();
        let len = table.len();
        add(
            table,
            plans,
            name,
            plan,
            &keys,
            &hashed,
            line,
            probs,
            &|o| place_of(lines, o),
        );
        if table.len() > len {
            lines.push(line as u32);
        }
    }
}
