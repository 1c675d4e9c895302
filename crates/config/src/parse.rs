//! YAML text → file types, reporting every problem at once with its line and column.
//!
//! serde stops at the first error. To go on, the text is read into a YAML value first; each
//! time the file types do not fit, the problem is recorded and the offending node is taken
//! out (an unknown field) or replaced by a stand-in of a fitting type, and the value is read
//! again. Validation then runs on what fits, leaving out what was already reported.

use crate::error::Problem;
use crate::file::FileConfig;
use serde_yaml_ng::{Mapping, Value};
use std::collections::HashMap;
use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

/// Most problems reported at parse level before giving up on the rest.
const MAX_PROBLEMS: usize = 50;

/// Where each node of a YAML document starts, by path (`routes[2].upstream`), and where
/// the key of each mapping entry is.
#[derive(Debug, Default)]
pub struct Positions {
    values: HashMap<String, (usize, usize)>,
    keys: HashMap<String, (usize, usize)>,
    /// Keys given twice in one mapping: the path and the place of the second.
    pub duplicates: Vec<(String, (usize, usize))>,
}

impl Positions {
    /// Indexes `text`; a text the YAML parser rejects yields no positions.
    pub fn of(text: &str) -> Positions {
        let mut idx = Indexer::default();
        let _ = Parser::new_from_str(text).load(&mut idx, false);
        Positions {
            values: idx.out,
            keys: idx.keys,
            duplicates: idx.duplicates,
        }
    }

    /// `line L column C` (1-based) of the node at `path`, or of its nearest parent known:
    /// where its value starts, or its key when the value starts on a later line (a block
    /// mapping or list under it).
    pub fn locate(&self, path: &str) -> Option<(usize, usize)> {
        let mut p = path;
        loop {
            if let Some(&at) = self.values.get(p) {
                return Some(match self.keys.get(p) {
                    Some(&key) if key.0 < at.0 => key,
                    _ => at,
                });
            }
            let cut = p.rfind(['.', '['])?;
            p = &p[..cut];
        }
    }

    /// `problem` with ` (line L, column C)` added when its place is known: a setting that
    /// should not be there is placed at its key.
    pub fn place(&self, mut problem: Problem) -> Problem {
        let key = problem
            .message
            .starts_with("unknown setting")
            .then(|| self.keys.get(&problem.path).copied())
            .flatten();
        if let Some((line, col)) = key.or_else(|| self.locate(&problem.path)) {
            if !problem.message.contains(" line ") {
                problem.message = format!("{} (line {line}, column {col})", problem.message);
            }
        }
        problem
    }
}

enum Frame {
    Map {
        path: String,
        /// The key read, waiting for its value, and where it is.
        key: Option<(String, (usize, usize))>,
        /// Keys seen in this mapping.
        seen: std::collections::HashSet<String>,
    },
    Seq {
        path: String,
        next: usize,
    },
}

#[derive(Default)]
struct Indexer {
    stack: Vec<Frame>,
    out: HashMap<String, (usize, usize)>,
    keys: HashMap<String, (usize, usize)>,
    duplicates: Vec<(String, (usize, usize))>,
}

impl Indexer {
    /// The path of the node that starts now, advancing the parent's position.
    fn child(&mut self) -> Option<String> {
        match self.stack.last_mut() {
            None => Some(String::new()),
            Some(Frame::Seq { path, next }) => {
                let p = format!("{path}[{next}]");
                *next += 1;
                Some(p)
            }
            Some(Frame::Map { path, key, .. }) => key.take().map(|(k, at)| {
                let p = if path.is_empty() {
                    k
                } else {
                    format!("{path}.{k}")
                };
                self.keys.entry(p.clone()).or_insert(at);
                p
            }),
        }
    }
}

impl MarkedEventReceiver for Indexer {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        let at = (mark.line(), mark.col() + 1);
        match ev {
            Event::Scalar(s, ..) => {
                if let Some(Frame::Map { key, seen, path }) = self.stack.last_mut() {
                    if key.is_none() {
                        if !seen.insert(s.clone()) {
                            let p = if path.is_empty() {
                                s.clone()
                            } else {
                                format!("{path}.{s}")
                            };
                            self.duplicates.push((p, at));
                        }
                        *key = Some((s, at));
                        return;
                    }
                }
                if let Some(p) = self.child() {
                    self.out.entry(p).or_insert(at);
                }
            }
            Event::Alias(_) => {
                if let Some(p) = self.child() {
                    self.out.entry(p).or_insert(at);
                }
            }
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                let path = self.child().unwrap_or_default();
                self.out.entry(path.clone()).or_insert(at);
                self.stack.push(if matches!(ev, Event::MappingStart(..)) {
                    Frame::Map {
                        path,
                        key: None,
                        seen: Default::default(),
                    }
                } else {
                    Frame::Seq { path, next: 0 }
                });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            _ => {}
        }
    }
}

/// One step of a path into a YAML value.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    Key(String),
    Index(usize),
}

fn steps(path: &serde_path_to_error::Path) -> Vec<Step> {
    use serde_path_to_error::Segment;
    path.iter()
        .filter_map(|s| match s {
            Segment::Map { key } => Some(Step::Key(key.clone())),
            Segment::Seq { index } => Some(Step::Index(*index)),
            Segment::Enum { variant } => Some(Step::Key(variant.clone())),
            Segment::Unknown => None,
        })
        .collect()
}

fn render(steps: &[Step]) -> String {
    let mut s = String::new();
    for st in steps {
        match st {
            Step::Key(k) if s.is_empty() => s.push_str(k),
            Step::Key(k) => {
                s.push('.');
                s.push_str(k);
            }
            Step::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

fn node_mut<'v>(v: &'v mut Value, steps: &[Step]) -> Option<&'v mut Value> {
    let mut cur = v;
    for st in steps {
        cur = match (st, cur) {
            (Step::Key(k), Value::Mapping(m)) => m.get_mut(k.as_str())?,
            (Step::Index(i), Value::Sequence(s)) => s.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(cur)
}

/// Stand-ins tried, in order, for a node of the wrong type.
fn stand_ins() -> [Value; 7] {
    [
        Value::Null,
        Value::Number(1.into()),
        Value::String("1s".into()),
        Value::String(String::new()),
        Value::Bool(false),
        Value::Sequence(Vec::new()),
        Value::Mapping(Mapping::new()),
    ]
}

/// What a try at reading the value found.
enum Read {
    Fits(Box<FileConfig>),
    Misfit { at: Vec<Step>, message: String },
}

fn read(v: &Value) -> Read {
    match serde_path_to_error::deserialize::<_, FileConfig>(v) {
        Ok(c) => Read::Fits(Box::new(c)),
        Err(e) => Read::Misfit {
            at: steps(e.path()),
            message: e.into_inner().to_string(),
        },
    }
}

/// What reading the text gave.
pub struct Parsed {
    /// The file types, with stand-ins where the text did not fit.
    pub file: FileConfig,
    /// Every parse-level problem (paths without positions; see [`Positions::place`]).
    pub problems: Vec<Problem>,
    /// Paths those problems cover: validation problems under them are not repeated.
    pub covered: Vec<String>,
}

/// Reads `text` into the file types, going on past every problem it can.
pub fn file_types(text: &str) -> Result<Parsed, Vec<Problem>> {
    let mut value: Value = serde_yaml_ng::from_str(text).map_err(|e| {
        // Every key given twice, each at its second place (the YAML reader names one, at
        // its mapping's start).
        let twice = Positions::of(text).duplicates;
        if twice.is_empty() {
            return vec![Problem::new("", format!("not valid YAML: {e}"))];
        }
        twice
            .into_iter()
            .map(|(path, (line, col))| {
                Problem::new(
                    path,
                    format!("given twice in one mapping (line {line}, column {col}); keep one"),
                )
            })
            .collect()
    })?;
    if value.is_null() {
        value = Value::Mapping(Mapping::new());
    }
    let mut problems = Vec::new();
    let mut covered: Vec<String> = Vec::new();
    while problems.len() < MAX_PROBLEMS {
        let (mut at, message) = match read(&value) {
            Read::Fits(c) => {
                return Ok(Parsed {
                    file: *c,
                    problems,
                    covered,
                })
            }
            Read::Misfit { at, message } => (at, message),
        };
        if let Some(field) = between(&message, "unknown field `", "`") {
            // Take the field out of its mapping.
            if at.last() != Some(&Step::Key(field.to_string())) {
                at.push(Step::Key(field.to_string()));
            }
            problems.push(Problem::new(render(&at), humanize(&message)));
            covered.push(render(&at));
            let key = at.pop();
            match (node_mut(&mut value, &at), key) {
                (Some(Value::Mapping(m)), Some(Step::Key(k))) => {
                    m.remove(k.as_str());
                }
                _ => break,
            }
            continue;
        }
        if let Some(field) = between(&message, "missing field `", "`") {
            at.push(Step::Key(field.to_string()));
            let path = render(&at);
            if !covered.contains(&path) {
                problems.push(Problem::new(path.clone(), format!("`{field}` is required")));
                covered.push(path);
            }
            let key = at.pop();
            let Some(Step::Key(k)) = key else { break };
            if !fill(&mut value, &at, Some(k)) {
                break;
            }
            continue;
        }
        let path = render(&at);
        if covered.contains(&path) {
            // A stand-in did not fit either: stop rather than loop.
            break;
        }
        problems.push(Problem::new(path.clone(), humanize(&message)));
        covered.push(path);
        if !fill(&mut value, &at, None) {
            break;
        }
    }
    if problems.is_empty() {
        problems.push(Problem::new("", "the file does not fit the config schema"));
    }
    Err(problems)
}

/// Puts a stand-in at `parent.key` (a missing field) or at `parent` itself (a node of the
/// wrong type) that lets reading go past it. Returns false when none does.
fn fill(value: &mut Value, at: &[Step], key: Option<String>) -> bool {
    let mut target: Vec<Step> = at.to_vec();
    if let Some(k) = &key {
        target.push(Step::Key(k.clone()));
    }
    let here = render(&target);
    for s in stand_ins() {
        let mut trial = value.clone();
        match &key {
            Some(k) => match node_mut(&mut trial, at) {
                Some(Value::Mapping(m)) => {
                    m.insert(Value::String(k.clone()), s);
                }
                _ => return false,
            },
            None => match node_mut(&mut trial, at) {
                Some(n) => *n = s,
                None => return false,
            },
        }
        let passes = match read(&trial) {
            Read::Fits(_) => true,
            Read::Misfit { at: next, message } => {
                let mut next_path = next.clone();
                if let Some(f) = between(&message, "missing field `", "`") {
                    next_path.push(Step::Key(f.to_string()));
                }
                render(&next_path) != here
            }
        };
        if passes {
            *value = trial;
            return true;
        }
    }
    false
}

fn between<'m>(s: &'m str, start: &str, end: &str) -> Option<&'m str> {
    let rest = &s[s.find(start)? + start.len()..];
    Some(&rest[..rest.find(end)?])
}

/// serde's wording, for people: no Rust type names.
pub fn humanize(message: &str) -> String {
    let expected = [
        ("expected u64", "must be a whole number ≥ 0"),
        ("expected usize", "must be a whole number ≥ 0"),
        ("expected u32", "must be a whole number ≥ 0"),
        ("expected u16", "must be a whole number ≥ 0"),
        ("expected u8", "must be a whole number ≥ 0"),
        ("expected a boolean", "must be true or false"),
        ("expected a string", "must be text"),
        ("expected a sequence", "must be a list"),
        ("expected a map", "must be a mapping (key: value lines)"),
        ("expected struct", "must be a mapping (key: value lines)"),
    ];
    if let Some(rest) = message.strip_prefix("invalid type: ") {
        for (needle, say) in expected {
            if let Some(i) = rest.find(needle) {
                let got = rest[..i].trim_end_matches([',', ' ']);
                return format!("{say} (found {got})");
            }
        }
    }
    if let Some(rest) = message.strip_prefix("invalid value: ") {
        for (needle, say) in expected {
            if let Some(i) = rest.find(needle) {
                let got = rest[..i].trim_end_matches([',', ' ']);
                return format!("{say} (found {got})");
            }
        }
    }
    if message.starts_with("unknown field `") {
        return message.replacen("unknown field", "unknown setting", 1);
    }
    message.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_by_path() {
        let p = Positions::of("a:\n  b: [x, {c: 1}]\nd: 2\n");
        assert_eq!(p.locate("a.b[1].c"), Some((2, 14)));
        assert_eq!(p.locate("d"), Some((3, 4)));
        assert_eq!(p.locate("a.b[7]"), Some((2, 6)));
    }

    #[test]
    fn a_setting_with_a_block_under_it_is_placed_at_its_key() {
        let p = Positions::of("a:\n  b:\n    c: 1\n  d: [1]\n");
        assert_eq!(p.locate("a.b"), Some((2, 3)));
        assert_eq!(p.locate("a.b.c"), Some((3, 8)));
        assert_eq!(p.locate("a.d"), Some((4, 6)));
        let unknown = p.place(Problem::new("a.b", "unknown setting `b`"));
        assert!(unknown.message.ends_with("(line 2, column 3)"), "{unknown}");
        let inline = Positions::of("a: {b: 1, zz: 2}\n");
        let unknown = inline.place(Problem::new("a.zz", "unknown setting `zz`"));
        assert!(
            unknown.message.ends_with("(line 1, column 11)"),
            "{unknown}"
        );
    }

    #[test]
    fn every_key_given_twice_is_named_at_its_second_place() {
        let text =
            "routes: []\nupstreams:\n  echo: {targets: [a]}\n  echo: {targets: [b]}\nroutes: []\n";
        let problems = match file_types(text) {
            Err(p) => p,
            Ok(_) => panic!("duplicate keys read"),
        };
        let said: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(
            said,
            [
                "upstreams.echo: given twice in one mapping (line 4, column 3); keep one",
                "routes: given twice in one mapping (line 5, column 1); keep one",
            ],
            "{said:?}"
        );
    }

    #[test]
    fn messages_name_no_rust_types() {
        assert_eq!(
            humanize("invalid type: string \"many\", expected u64"),
            "must be a whole number ≥ 0 (found string \"many\")"
        );
    }
}
