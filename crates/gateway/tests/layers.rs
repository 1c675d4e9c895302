//! The house's invariants, read from the code's own paths (`use` lines and paths in code):
//! no module of any crate imports, directly or through others, a module that imports it
//! back; and in this crate no import runs from a lower layer of ARCHITECTURE.md to a higher
//! one, and every module stands on a layer there.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One token of Rust source, as far as paths need it.
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Path,
    Open,
    Close,
    Comma,
    Semi,
    Star,
    Other,
}

/// Tokens of `src`, without comments, strings and char literals.
fn tokens(src: &str) -> Vec<Tok> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'#') | Some(b'"')) {
            // A raw string: r"…" or r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(Tok::Ident("r".into()));
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"'
                    && b[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == b'#')
                        .count()
                        == hashes
                {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
            out.push(Tok::Other);
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push(Tok::Other);
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 3;
            } else {
                // A multi-byte char literal, or a lifetime.
                let end = src[i + 1..].char_indices().nth(1).map(|(k, _)| i + 1 + k);
                match end {
                    Some(e) if b.get(e) == Some(&b'\'') => i = e + 1,
                    _ => i += 1,
                }
            }
            out.push(Tok::Other);
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let s = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(src[s..i].to_string()));
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b':' && b.get(i + 1) == Some(&b':') {
            out.push(Tok::Path);
            i += 2;
        } else {
            out.push(match c {
                b'{' => Tok::Open,
                b'}' => Tok::Close,
                b',' => Tok::Comma,
                b';' => Tok::Semi,
                b'*' => Tok::Star,
                _ => Tok::Other,
            });
            i += 1;
        }
    }
    out
}

/// The paths of a `use` tree starting at `toks[*i]`, each with `prefix` before it.
fn use_tree(toks: &[Tok], i: &mut usize, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let depth = prefix.len();
    loop {
        match toks.get(*i) {
            Some(Tok::Open) => {
                *i += 1;
                loop {
                    match toks.get(*i) {
                        Some(Tok::Close) => {
                            *i += 1;
                            break;
                        }
                        Some(Tok::Comma) => *i += 1,
                        None => break,
                        _ => use_tree(toks, i, prefix, out),
                    }
                }
                break;
            }
            Some(Tok::Ident(s)) => {
                prefix.push(s.clone());
                *i += 1;
                if toks.get(*i) == Some(&Tok::Path) {
                    *i += 1;
                    continue;
                }
                if toks.get(*i) == Some(&Tok::Ident("as".into())) {
                    *i += 2;
                }
                out.push(prefix.clone());
                break;
            }
            Some(Tok::Star) => {
                *i += 1;
                out.push(prefix.clone());
                break;
            }
            _ => break,
        }
    }
    prefix.truncate(depth);
}

/// A source file: its module path in its crate, and the module paths it names.
struct File {
    rel: String,
    module: Vec<String>,
    named: Vec<Vec<String>>,
}

/// The module path of a file at `rel` (relative to `src/`).
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// Every path `src` names through `crate`, `super`, `self` or a child module, made absolute
/// from `module` (the file's module; inline modules are followed).
fn named_paths(src: &str, module: &[String]) -> Vec<Vec<String>> {
    let toks = tokens(src);
    // Child modules declared in the file (`mod x;`), at any inline depth.
    let kids: BTreeSet<String> = toks
        .windows(3)
        .filter_map(|w| match w {
            [Tok::Ident(m), Tok::Ident(name), Tok::Semi] if m == "mod" => Some(name.clone()),
            _ => None,
        })
        .collect();
    let mut out = Vec::new();
    // The inline module each brace opens (None for other braces).
    let mut stack: Vec<Option<String>> = Vec::new();
    let here = |stack: &[Option<String>]| -> Vec<String> {
        let mut m = module.to_vec();
        m.extend(stack.iter().flatten().cloned());
        m
    };
    let absolute = |base: Vec<String>, path: &[String]| -> Option<Vec<String>> {
        let mut cur = base;
        let mut rest = path;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                cur.clear();
                rest = &rest[1..];
            }
            Some("super" | "self") => {
                while let Some(first) = rest.first() {
                    match first.as_str() {
                        "super" => {
                            cur.pop()?;
                        }
                        "self" => {}
                        _ => break,
                    }
                    rest = &rest[1..];
                }
            }
            Some(first) if kids.contains(first) => {}
            _ => return None,
        }
        cur.extend(rest.iter().cloned());
        Some(cur)
    };
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Ident(m) if m == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Open)) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    stack.push(Some(name.clone()));
                    i += 3;
                    continue;
                }
                i += 1;
            }
            Tok::Ident(u) if u == "use" => {
                i += 1;
                let mut paths = Vec::new();
                use_tree(&toks, &mut i, &mut Vec::new(), &mut paths);
                let base = here(&stack);
                out.extend(paths.iter().filter_map(|p| absolute(base.clone(), p)));
            }
            Tok::Ident(first) if toks.get(i + 1) == Some(&Tok::Path) => {
                // An inline path: a::b::c (a name after `::` is never its start).
                let starts = i == 0 || toks[i - 1] != Tok::Path;
                let mut path = vec![first.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::Path) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(s)) => path.push(s.clone()),
                        _ => break,
                    }
                    j += 2;
                }
                if starts {
                    if let Some(p) = absolute(here(&stack), &path) {
                        out.push(p);
                    }
                }
                i = j.max(i + 1);
            }
            Tok::Open => {
                stack.push(None);
                i += 1;
            }
            Tok::Close => {
                stack.pop();
                i += 1;
            }
            _ => i += 1,
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn read_crate(src: &Path) -> Vec<File> {
    let mut paths = Vec::new();
    rust_files(src, &mut paths);
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let rel = p
                .strip_prefix(src)
                .expect("under src")
                .to_string_lossy()
                .replace('\\', "/");
            let text = std::fs::read_to_string(p).expect("readable source");
            let module = module_of(&rel);
            let named = named_paths(&text, &module);
            File { rel, module, named }
        })
        .collect()
}

/// file → the other files it imports, with the names it takes.
type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

fn graph(files: &[File]) -> Graph {
    let by_module: BTreeMap<&[String], &str> = files
        .iter()
        .map(|f| (f.module.as_slice(), f.rel.as_str()))
        .collect();
    let mut g = Graph::new();
    for f in files {
        let edges = g.entry(f.rel.clone()).or_default();
        for p in &f.named {
            // The file of the longest prefix that is a file's module.
            let target = (1..=p.len())
                .rev()
                .find_map(|n| by_module.get(&p[..n]).copied());
            if let Some(t) = target.filter(|t| *t != f.rel) {
                edges
                    .entry(t.to_string())
                    .or_default()
                    .insert(p.last().cloned().unwrap_or_default());
            }
        }
    }
    g
}

/// The strongly connected groups of more than one file (Tarjan).
fn circles(g: &Graph) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        let g = t.g;
        for w in g.get(v).into_iter().flat_map(|e| e.keys()) {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low[v];
                t.low.insert(v, lv.min(lw));
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low[v];
                t.low.insert(v, lv.min(iw));
            }
        }
        if t.low[v] == t.index[v] {
            let mut group = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                group.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                t.out.push(group);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn explain(g: &Graph, group: &[String]) -> String {
    let mut s = String::new();
    for a in group {
        for (b, names) in g.get(a).into_iter().flatten() {
            if group.contains(b) {
                let names: Vec<_> = names.iter().cloned().collect();
                s.push_str(&format!("\n  {a} -> {b}: {}", names.join(", ")));
            }
        }
    }
    s
}

#[test]
fn no_crate_has_a_module_circle() {
    let root = workspace();
    let mut found = Vec::new();
    for c in ["gateway", "config", "cli", "bench"] {
        let src = root.join("crates").join(c).join("src");
        if !src.is_dir() {
            continue;
        }
        let files = read_crate(&src);
        assert!(!files.is_empty(), "no sources under {}", src.display());
        let g = graph(&files);
        for group in circles(&g) {
            found.push(format!("crates/{c}: {}", explain(&g, &group)));
        }
    }
    assert!(found.is_empty(), "module circles:\n{}", found.join("\n"));
}

/// The layers of ARCHITECTURE.md's table: `| n | name | `a`, `b` | … |`, module → layer.
fn layers() -> BTreeMap<String, usize> {
    let text = std::fs::read_to_string(workspace().join("ARCHITECTURE.md"))
        .expect("ARCHITECTURE.md at the workspace root");
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (Some(n), Some(mods)) = (
            cells.get(1).and_then(|c| c.parse::<usize>().ok()),
            cells.get(3),
        ) else {
            continue;
        };
        for m in mods.split('`').skip(1).step_by(2) {
            let m = m.trim_end_matches('/').trim_end_matches(".rs");
            assert!(out.insert(m.to_string(), n).is_none(), "{m} on two layers");
        }
    }
    assert!(!out.is_empty(), "ARCHITECTURE.md has no layer table");
    out
}

#[test]
fn imports_run_down_the_layers_of_architecture_md() {
    let layers = layers();
    let files = read_crate(&workspace().join("crates/gateway/src"));
    let g = graph(&files);
    let top = |rel: &str| -> String {
        let m = module_of(rel);
        m.first().cloned().unwrap_or_else(|| "lib".to_string())
    };
    let mut problems = Vec::new();
    for f in &files {
        let a = top(&f.rel);
        let Some(&la) = layers.get(&a) else {
            problems.push(format!("{} (module `{a}`) stands on no layer", f.rel));
            continue;
        };
        for (b_file, names) in g.get(&f.rel).into_iter().flatten() {
            let b = top(b_file);
            if a == b {
                continue;
            }
            let lb = layers.get(&b).copied().unwrap_or(usize::MAX);
            if lb >= la {
                let names: Vec<_> = names.iter().cloned().collect();
                problems.push(format!(
                    "{} (layer {la}) imports {b_file} (layer {lb}): {}",
                    f.rel,
                    names.join(", ")
                ));
            }
        }
    }
    for m in layers.keys() {
        let known = files.iter().any(|f| top(&f.rel) == *m);
        if !known {
            problems.push(format!("ARCHITECTURE.md names `{m}`, which is no module"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_reader_finds_what_it_must() {
    let src = "use crate::a::{b::{C, d}, e as f};\nuse super::g;\nmod k;\nfn x() { k::y::z(); crate::m::n(); \"crate::no\"; }\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n";
    let got = named_paths(src, &["p".to_string(), "q".to_string()]);
    let want: Vec<Vec<String>> = [
        "a::b::C",
        "a::b::d",
        "a::e",
        "p::g",
        "p::q::k::y::z",
        "m::n",
        "p::q",
    ]
    .iter()
    .map(|s| s.split("::").map(String::from).collect())
    .collect();
    for w in &want {
        assert!(got.contains(w), "missing {w:?} in {got:?}");
    }
    assert!(
        !got.iter().any(|p| p.contains(&"no".to_string())),
        "{got:?}"
    );
    let g: Graph = [
        ("a".to_string(), [("b".to_string(), BTreeSet::new())].into()),
        ("b".to_string(), [("a".to_string(), BTreeSet::new())].into()),
        ("c".to_string(), [("a".to_string(), BTreeSet::new())].into()),
    ]
    .into();
    assert_eq!(circles(&g), vec![vec!["a".to_string(), "b".to_string()]]);
}

#[test]
fn no_source_file_is_over_600_lines() {
    let root = workspace();
    let mut long = Vec::new();
    for c in ["gateway", "config", "cli", "bench"] {
        let mut paths = Vec::new();
        rust_files(&root.join("crates").join(c).join("src"), &mut paths);
        for p in paths {
            // Unit tests kept beside their module are tests, not the module.
            if p.file_name()
                .is_some_and(|n| n.to_string_lossy().ends_with("tests.rs"))
            {
                continue;
            }
            let n = std::fs::read_to_string(&p)
                .expect("readable")
                .lines()
                .count();
            if n > 600 {
                long.push(format!("{} ({n} lines)", p.display()));
            }
        }
    }
    assert!(long.is_empty(), "split these: {}", long.join(", "));
}
