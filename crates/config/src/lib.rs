//! tollgate's configuration: the YAML file as written ([`file`]), and the validated
//! [`Config`] the gateway runs on ([`model`]).
//!
//! Loading is two steps: the text is deserialized into file types (unknown fields are
//! rejected), then validated into runtime types. Validation reports every problem at
//! once, each with its place in the file (`routes[2].upstream: unknown upstream "orders"`).
// One `unsafe` call, `madvise` in `huge`: huge pages for the per-consumer arrays (measured).
#![deny(unsafe_code)]

pub mod consumers;
mod consumers_file;
pub mod error;
pub mod file;
#[doc(hidden)]
pub mod fuzz;
pub mod huge;
mod key_table;
pub mod model;
pub mod parse;
pub mod tls;
pub mod token;
pub mod units;
mod validate;

pub use consumers::{key_digest, Consumers};
pub use consumers_file::parse_digest;
pub use error::{ConfigError, Problem};
pub use model::*;
pub use tls::RedisTls;
pub use token::*;
pub use validate::same_file;

use std::path::Path;

/// Parses and validates a config from YAML text; relative file names in it are read from
/// the current directory.
pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
    from_yaml_in(text, Path::new("."))
}

/// Parses and validates a config from YAML text, reading relative file names from `base`.
/// Every problem is reported, parse-level ones included, each with its place in the file.
pub fn from_yaml_in(text: &str, base: &Path) -> Result<Config, ConfigError> {
    from_yaml_with(text, base, false)
}

/// [`from_yaml_in`], with the config's plain keys indexed by digest whatever the file says
/// when `index_digests` (a running gateway whose admin API may give keys).
fn from_yaml_with(text: &str, base: &Path, index_digests: bool) -> Result<Config, ConfigError> {
    // Positions take a second parse of the text: only for a file with problems.
    let placed = |ps: Vec<Problem>, ws: Vec<Problem>| {
        let positions = parse::Positions::of(text);
        ConfigError::Invalid {
            problems: ps.into_iter().map(|p| positions.place(p)).collect(),
            warnings: ws.into_iter().map(|w| positions.place(w)).collect(),
        }
    };
    let parsed = parse::file_types(text).map_err(|ps| placed(ps, Vec::new()))?;
    let mut problems: Vec<Problem> = parsed.problems;
    let covered = parsed.covered;
    // A limit's name made from its count and window is covered with them: made from a
    // stand-in, it would be named twice.
    let derived_from = |path: &str, c: &str| {
        path.strip_suffix(".name")
            .is_some_and(|item| c == format!("{item}.per") || c == format!("{item}.requests"))
    };
    let under = |path: &str| {
        covered.iter().any(|c| {
            path == c
                || derived_from(path, c)
                || path
                    .strip_prefix(c.as_str())
                    .is_some_and(|rest| rest.starts_with(['.', '[']))
                || c.strip_prefix(path)
                    .is_some_and(|rest| rest.starts_with(['.', '[']))
        })
    };
    let warnings = match validate::validate(parsed.file, base, index_digests) {
        Ok(mut cfg) if problems.is_empty() => {
            if !cfg.warnings.is_empty() {
                let positions = parse::Positions::of(text);
                cfg.warnings = std::mem::take(&mut cfg.warnings)
                    .into_iter()
                    .map(|w| positions.place(w))
                    .collect();
            }
            return Ok(cfg);
        }
        Ok(cfg) => cfg.warnings,
        Err(ConfigError::Invalid {
            problems: ps,
            warnings: ws,
        }) => {
            problems.extend(ps.into_iter().filter(|p| !under(&p.path)));
            ws
        }
        Err(e) => return Err(e),
    };
    Err(placed(problems, warnings))
}

/// Reads, parses and validates a config file.
pub fn from_path(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        path: path.display().to_string(),
        source: e,
    })?;
    from_text_of(&text, path)
}

/// Parses and validates `text`, read from the config file at `path` (relative file names
/// in it are read beside it), and checks that the files it writes are not the file itself.
pub fn from_text_of(text: &str, path: &Path) -> Result<Config, ConfigError> {
    from_text_for(text, path, false)
}

/// [`from_text_of`] for a running gateway: `manages_keys` when its admin API may give keys
/// (it started with `admin:` or `cluster:`, or manages consumers already), so that the
/// config's plain keys are indexed by digest even if the new file drops `admin:` (which
/// takes effect at the next restart).
pub fn from_text_for(text: &str, path: &Path, manages_keys: bool) -> Result<Config, ConfigError> {
    let base = path.parent().filter(|p| !p.as_os_str().is_empty());
    let mut cfg = from_yaml_with(text, base.unwrap_or(Path::new(".")), manages_keys)?;
    // Read while it exists, too: changes made while the admin API was on (a revoked key)
    // hold after it is turned off.
    if cfg.consumers_log.is_none() {
        let implied = implied_consumers_log(path);
        if cfg.admin.is_some() || cfg.cluster.is_some() || implied.exists() {
            cfg.consumers_log = Some(implied);
            cfg.consumers_log_implied = true;
        }
    }
    // A log of changes beside the config file that this config does not keep (it names
    // another, or a consumers file whose log is elsewhere): starting without it would
    // bring back the consumers and keys it deleted.
    let implied = implied_consumers_log(path);
    let has_records = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.len() > 0);
    if let Some(log) = cfg.consumers_log.as_deref() {
        if !cfg.consumers_log_implied
            && has_records(&implied)
            && !validate::same_file(log, &implied)
        {
            let key = if text_names(text, "consumers_log") {
                "consumers_log"
            } else {
                "consumers_file"
            };
            let problem = Problem::new(
                key,
                format!(
                    "the consumer change log {} holds changes made through the admin API, but this config keeps its changes in {}: starting without them would undo them (deleted consumers and revoked keys back); move it there, or name it in consumers_log",
                    implied.display(),
                    log.display()
                ),
            );
            return Err(ConfigError::invalid(vec![
                parse::Positions::of(text).place(problem)
            ]));
        }
    }
    // The change log is appended to: naming the config file itself would spoil it.
    if cfg
        .consumers_log
        .as_deref()
        .is_some_and(|l| validate::same_file(l, path))
    {
        let problem = Problem::new(
            "consumers_log",
            "names this config file: the change log is appended to, so it needs a file of its own",
        );
        return Err(ConfigError::invalid(vec![
            parse::Positions::of(text).place(problem)
        ]));
    }
    Ok(cfg)
}

/// Whether the YAML text sets `key` at its top level.
fn text_names(text: &str, key: &str) -> bool {
    text.lines().any(|l| {
        l.strip_prefix(key)
            .is_some_and(|r| r.trim_start().starts_with(':'))
    })
}

/// Where a config file that names neither `consumers_log` nor `consumers_file` keeps the
/// consumers its admin API changes: beside it, `<its name without extension>.consumers.changes`
/// (one per config file, so that nodes run from files side by side keep a log each).
pub fn implied_consumers_log(config: &Path) -> std::path::PathBuf {
    let stem = config
        .file_stem()
        .map_or_else(|| "tollgate".into(), |s| s.to_string_lossy());
    config.with_file_name(format!("{stem}.consumers.changes"))
}

/// The `log.format` a config file asks for, read before the file is validated (the
/// process log is set up first, so that what is wrong with the file is written in it).
/// `None` when the file names none or is not YAML.
pub fn log_format_of(text: &str) -> Option<LogFormat> {
    #[derive(serde::Deserialize)]
    struct Peek {
        log: Option<PeekLog>,
    }
    #[derive(serde::Deserialize)]
    struct PeekLog {
        format: Option<LogFormat>,
    }
    let peek: Peek = serde_yaml_ng::from_str(text).ok()?;
    peek.log?.format
}

/// What the usage history and the access log name a request without a consumer: never a
/// consumer's name.
pub const NO_CONSUMER: &str = "-";

/// A fingerprint of file content, to tell a change from the content running. The same as
/// [`Fingerprint`] gives the content added in pieces.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    let mut f = Fingerprint::default();
    f.add(bytes);
    f.finish()
}

/// A [`fingerprint`] made piece by piece, as a file is read, so that a large file (a
/// million consumers) is never held whole to be told apart.
#[derive(Default)]
pub struct Fingerprint(std::hash::DefaultHasher);

impl Fingerprint {
    /// Adds the next piece of the content.
    pub fn add(&mut self, bytes: &[u8]) {
        std::hash::Hasher::write(&mut self.0, bytes);
    }

    /// The fingerprint of all the pieces added (never 0, which stands for "none").
    pub fn finish(&self) -> u64 {
        std::hash::Hasher::finish(&self.0) | 1
    }
}

/// The [`fingerprint`] of the file at `path`, read in pieces of 64 KiB.
pub fn fingerprint_file(path: &Path) -> std::io::Result<u64> {
    let mut f = Fingerprint::default();
    read_pieces(&mut std::fs::File::open(path)?, |piece| f.add(piece))?;
    Ok(f.finish())
}

/// Reads `from` to its end in pieces of 64 KiB, each handed to `each`: a large file is
/// never held whole.
pub(crate) fn read_pieces(
    from: &mut impl std::io::Read,
    mut each: impl FnMut(&[u8]),
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => each(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// A URL as it may be shown (the log, `/config`, `/metrics`, an error): its user info
/// (`user:password@`), its query's values and its fragment replaced by `<redacted>`,
/// where credentials go. Text that is no URL comes back as it is. A URL that does not
/// parse (a password holding an unencoded `/`, `?` or `#` is the usual reason) loses
/// everything up to its last `@`.
pub fn redacted_url(raw: &str) -> String {
    const MARK: &str = "<redacted>";
    let Some(s) = raw.find("://") else {
        return raw.to_string();
    };
    let (head, rest) = raw.split_at(s + 3);
    let valid = url::Url::parse(raw).is_ok();
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (user_end, host_at) = match (valid, rest[..authority_end].rfind('@'), rest.rfind('@')) {
        (true, Some(at), _) => (Some(at), at + 1),
        (true, None, _) => (None, 0),
        (false, _, Some(at)) => (Some(at), at + 1),
        (false, _, None) => (None, 0),
    };
    let mut out = String::with_capacity(raw.len() + MARK.len());
    out.push_str(head);
    if user_end.is_some() {
        out.push_str(MARK);
        out.push('@');
    }
    let rest = &rest[host_at..];
    let (rest, fragment) = match rest.find('#') {
        Some(i) => (&rest[..i], Some(())),
        None => (rest, None),
    };
    match rest.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            for (i, pair) in query.split('&').enumerate() {
                if i > 0 {
                    out.push('&');
                }
                match pair.split_once('=') {
                    Some((name, _)) => {
                        out.push_str(name);
                        out.push('=');
                        out.push_str(MARK);
                    }
                    // A bare value (`?SECRET`) may be a token as well.
                    None if !pair.is_empty() => out.push_str(MARK),
                    None => {}
                }
            }
        }
        None => out.push_str(rest),
    }
    if fragment.is_some() {
        out.push('#');
        out.push_str(MARK);
    }
    out
}

/// `text` with every URL in it shown as [`redacted_url`] shows it: for messages that
/// quote what the file says (a problem, a parse error), whatever made them.
pub fn redacted_text(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains("://") {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        // The scheme: letters, digits, `+`, `-`, `.` before `://`.
        let start = rest[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || "+-.".contains(c)))
            .map_or(0, |i| i + 1);
        // Quoted (`"…"`, as `{:?}` writes it), the URL runs to the closing quote;
        // otherwise to the next space.
        let quoted = rest[..start].ends_with('"');
        let after = &rest[at + 3..];
        let len = if quoted {
            let b = after.as_bytes();
            let mut i = 0;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i.min(b.len())
        } else {
            after.find(char::is_whitespace).unwrap_or(after.len())
        };
        let end = at + 3 + len;
        out.push_str(&rest[..start]);
        out.push_str(&redacted_url(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

/// Percent-encodes all but the unreserved characters of RFC 3986 (`A-Z a-z 0-9 - . _ ~`):
/// a password put into a Redis URL, a path segment or query value for the admin API.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redacted_url;

    #[test]
    fn a_file_read_in_pieces_has_the_fingerprint_of_its_content_whole() {
        let path = std::env::temp_dir().join(format!("tollgate-fp-{}", std::process::id()));
        // Past three 64 KiB pieces, ending within a fourth.
        let content: Vec<u8> = (0..200_003u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &content).expect("write");
        let whole = super::fingerprint(&content);
        assert_eq!(super::fingerprint_file(&path).expect("read"), whole);
        let mut pieces = super::Fingerprint::default();
        for piece in content.chunks(1_000) {
            pieces.add(piece);
        }
        assert_eq!(pieces.finish(), whole);
        assert_ne!(super::fingerprint(&content[1..]), whole);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_shown_url_keeps_no_credentials() {
        for (raw, shown) in [
            (
                "https://user:hunter2@idp.test/jwks?key=abc&x",
                "https://<redacted>@idp.test/jwks?key=<redacted>&<redacted>",
            ),
            (
                "redis://:hunter2@10.0.0.1:6379/0",
                "redis://<redacted>@10.0.0.1:6379/0",
            ),
            ("https://TOKEN@idp.test", "https://<redacted>@idp.test"),
            // An `@` after the host is the path's, not user info.
            ("https://idp.test/a@b", "https://idp.test/a@b"),
            (
                "https://idp.test/k#access_token=1",
                "https://idp.test/k#<redacted>",
            ),
            (
                "https://idp.test/k?code=s#f",
                "https://idp.test/k?code=<redacted>#<redacted>",
            ),
            // Passwords with characters that end an authority: the URL does not parse.
            (
                "redis://:pa#ss@10.0.0.1:6379/0",
                "redis://<redacted>@10.0.0.1:6379/0",
            ),
            (
                "https://u:p/w@idp.test/keys",
                "https://<redacted>@idp.test/keys",
            ),
            ("redis://:p?w@h:6379", "redis://<redacted>@h:6379"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redacted_url(raw), shown, "{raw}");
        }
    }

    #[test]
    fn urls_quoted_in_a_message_are_shown_without_credentials() {
        use super::redacted_text;
        assert_eq!(
            redacted_text(r#"cluster.redis: "redis://:pa#ss@10.0.0.1:6379/0" is not a valid URL"#),
            r#"cluster.redis: "redis://<redacted>@10.0.0.1:6379/0" is not a valid URL"#
        );
        assert_eq!(
            redacted_text(r#"invalid type: string "https://u:p w@h", expected a sequence"#),
            r#"invalid type: string "https://<redacted>@h", expected a sequence"#
        );
        assert_eq!(
            redacted_text("targets[0]: https://svc:s3cret@api:8443 has user info"),
            "targets[0]: https://<redacted>@api:8443 has user info"
        );
        assert_eq!(redacted_text("no url here"), "no url here");
    }
}
