//! A request head as the request path carries it: method, target, version and header
//! fields. An HTTP/1.1 request's field names stay slices of the head as it was read: no
//! map is built and no name hashed unless a phase hands the fields to a client that takes
//! a map. Names are compared without regard to case, as HTTP reads them (RFC 9110 §5.1).

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Extensions, Method, Uri, Version};

/// A request's head: what `http::request::Parts` holds, with [`Fields`] for headers.
#[derive(Debug, Default)]
pub struct Parts {
    /// The method.
    pub method: Method,
    /// The request target.
    pub uri: Uri,
    /// HTTP/1.0, HTTP/1.1 or HTTP/2.
    pub version: Version,
    /// The header fields, in order.
    pub headers: Fields,
    /// What the listener hands the phases beside the head (an upgrade's other end).
    pub extensions: Extensions,
}

impl Parts {
    /// A head of `method`, `uri`, `version` and `headers`, without extensions.
    pub fn new(method: Method, uri: Uri, version: Version, headers: Fields) -> Self {
        Parts {
            method,
            uri,
            version,
            headers,
            extensions: Extensions::new(),
        }
    }

    /// A copy without the extensions (they are the listener's, for this request only).
    pub fn copy(&self) -> Self {
        Parts::new(
            self.method.clone(),
            self.uri.clone(),
            self.version,
            self.headers.clone(),
        )
    }
}

impl From<http::request::Parts> for Parts {
    fn from(p: http::request::Parts) -> Self {
        Parts {
            method: p.method,
            uri: p.uri,
            version: p.version,
            headers: Fields::from(p.headers),
            extensions: p.extensions,
        }
    }
}

/// A field's name: where it lies in the head it was read from, as written, or one the
/// request path set.
#[derive(Debug, Clone)]
enum Name {
    At(usize, usize),
    Set(HeaderName),
}

#[derive(Debug, Clone)]
struct Field {
    name: Name,
    value: HeaderValue,
}

/// A request's header fields, in the order they came, then those the request path set.
#[derive(Clone, Default)]
pub struct Fields {
    /// The head the names of [`Name::At`] lie in.
    head: Bytes,
    list: Vec<Field>,
}

/// Whether `a` and `b` are the same field name (names are case-insensitive).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.eq_ignore_ascii_case(b)
}

impl Fields {
    /// Room for `n` fields whose names lie in `head`.
    pub fn in_head(head: Bytes, n: usize) -> Self {
        Fields {
            head,
            list: Vec::with_capacity(n),
        }
    }

    /// Room for `n` fields.
    pub fn with_capacity(n: usize) -> Self {
        Fields {
            head: Bytes::new(),
            list: Vec::with_capacity(n),
        }
    }

    /// Adds a field whose name is `name` (a range of the head, already checked to be a
    /// field name by the parser that found it).
    pub fn push_at(&mut self, name: std::ops::Range<usize>, value: HeaderValue) {
        if name.start >= name.end || name.end > self.head.len() {
            debug_assert!(false, "a name outside the head: {name:?}");
            return;
        }
        self.list.push(Field {
            name: Name::At(name.start, name.end),
            value,
        });
    }

    fn name_of<'a>(head: &'a [u8], f: &'a Field) -> &'a [u8] {
        match &f.name {
            Name::At(a, b) => &head[*a..*b],
            Name::Set(n) => n.as_str().as_bytes(),
        }
    }

    /// The first value of `name`.
    pub fn get<N: AsRef<str>>(&self, name: N) -> Option<&HeaderValue> {
        let n = name.as_ref().as_bytes();
        self.list
            .iter()
            .find(|f| same(Self::name_of(&self.head, f), n))
            .map(|f| &f.value)
    }

    /// Every value of `name`, in order.
    pub fn get_all<N: AsRef<str>>(&self, name: N) -> Values<'_, N> {
        Values {
            head: &self.head,
            list: self.list.iter(),
            name,
        }
    }

    /// Whether a field `name` is present.
    pub fn contains_key<N: AsRef<str>>(&self, name: N) -> bool {
        self.get(name).is_some()
    }

    /// Sets `name` to `value` alone: every field of that name goes, and this one is added
    /// at the end. Returns the first value removed.
    pub fn insert(&mut self, name: HeaderName, value: HeaderValue) -> Option<HeaderValue> {
        let old = self.remove(&name);
        self.list.push(Field {
            name: Name::Set(name),
            value,
        });
        old
    }

    /// Adds a field at the end.
    pub fn append(&mut self, name: HeaderName, value: HeaderValue) {
        self.list.push(Field {
            name: Name::Set(name),
            value,
        });
    }

    /// Removes every field of `name`; returns the first value removed.
    pub fn remove<N: AsRef<str>>(&mut self, name: N) -> Option<HeaderValue> {
        let n = name.as_ref().as_bytes();
        let head = &self.head;
        // Most removals find nothing: a look first, no rewrite of the list.
        let at = self
            .list
            .iter()
            .position(|f| same(Self::name_of(head, f), n))?;
        if !self.list[at + 1..]
            .iter()
            .any(|f| same(Self::name_of(head, f), n))
        {
            return Some(self.list.remove(at).value);
        }
        let mut first = None;
        self.list.retain(|f| {
            if !same(Self::name_of(head, f), n) {
                return true;
            }
            if first.is_none() {
                first = Some(f.value.clone());
            }
            false
        });
        first
    }

    /// Keeps only the fields for which `keep(name, value)` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&[u8], &HeaderValue) -> bool) {
        let head = &self.head;
        self.list.retain(|f| keep(Self::name_of(head, f), &f.value));
    }

    /// Every field's name (as written) and value, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &HeaderValue)> + '_ {
        self.list
            .iter()
            .map(|f| (Self::name_of(&self.head, f), &f.value))
    }

    /// Every field's name, as written.
    pub fn names(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.list.iter().map(|f| Self::name_of(&self.head, f))
    }

    /// How many fields there are.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The fields as a map, for a client that takes one (names lower-cased).
    pub fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.list.len());
        for f in &self.list {
            let name = match &f.name {
                Name::Set(n) => n.clone(),
                // Checked to be a field name when the head was parsed.
                Name::At(..) => match HeaderName::from_bytes(Self::name_of(&self.head, f)) {
                    Ok(n) => n,
                    Err(_) => continue,
                },
            };
            map.append(name, f.value.clone());
        }
        map
    }
}

/// The fields alone: the head also holds what was taken out of it (credentials).
impl std::fmt::Debug for Fields {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(n, v)| (String::from_utf8_lossy(n), v)))
            .finish()
    }
}

impl From<HeaderMap> for Fields {
    fn from(map: HeaderMap) -> Self {
        let mut fields = Fields::with_capacity(map.len());
        let mut last = None;
        for (name, value) in map {
            // A map yields a name once, then `None` for its further values.
            if let Some(n) = name {
                last = Some(n);
            }
            if let Some(n) = &last {
                fields.append(n.clone(), value);
            }
        }
        fields
    }
}

/// The values of one name, in order: [`Fields::get_all`].
pub struct Values<'a, N> {
    head: &'a [u8],
    list: std::slice::Iter<'a, Field>,
    name: N,
}

impl<'a, N: AsRef<str>> Values<'a, N> {
    /// The values themselves (as `http::header::GetAll::iter`).
    pub fn iter(self) -> Self {
        self
    }
}

impl<'a, N: AsRef<str>> Iterator for Values<'a, N> {
    type Item = &'a HeaderValue;

    fn next(&mut self) -> Option<&'a HeaderValue> {
        let n = self.name.as_ref().as_bytes();
        let head = self.head;
        self.list
            .by_ref()
            .find(|f| same(Fields::name_of(head, f), n))
            .map(|f| &f.value)
    }
}

/// Header fields by name, in a response's map or a request's [`Fields`], for what judges
/// or trims both (cache rules, hop-by-hop headers).
pub trait Lines {
    /// Every value of `name`, in order.
    fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a HeaderValue> + 'a;

    /// Whether any field's name (as written) satisfies `pred`.
    fn any_name(&self, pred: impl FnMut(&[u8]) -> bool) -> bool;

    /// Removes every field whose name (as written) satisfies `drop`.
    fn strip_where(&mut self, drop: impl FnMut(&[u8]) -> bool);

    /// The first value of `name`.
    fn first<'a>(&'a self, name: &'a str) -> Option<&'a HeaderValue> {
        self.values(name).next()
    }
}

impl Lines for HeaderMap {
    fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a HeaderValue> + 'a {
        self.get_all(name).iter()
    }

    fn any_name(&self, mut pred: impl FnMut(&[u8]) -> bool) -> bool {
        self.keys().any(|k| pred(k.as_str().as_bytes()))
    }

    fn strip_where(&mut self, mut drop: impl FnMut(&[u8]) -> bool) {
        let names: smallvec::SmallVec<[HeaderName; 4]> = self
            .keys()
            .filter(|k| drop(k.as_str().as_bytes()))
            .cloned()
            .collect();
        for n in names {
            self.remove(n);
        }
    }
}

impl Lines for Fields {
    fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a HeaderValue> + 'a {
        self.get_all(name)
    }

    fn any_name(&self, pred: impl FnMut(&[u8]) -> bool) -> bool {
        self.names().any(pred)
    }

    fn strip_where(&mut self, mut drop: impl FnMut(&[u8]) -> bool) {
        self.retain(|name, _| !drop(name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(head: &'static [u8]) -> Fields {
        // "Name: value" lines, one per `\n`.
        let bytes = Bytes::from_static(head);
        let mut f = Fields::in_head(bytes.clone(), 4);
        let mut at = 0;
        for line in head.split(|b| *b == b'\n') {
            let colon = line.iter().position(|b| *b == b':').expect("colon");
            let value = HeaderValue::from_bytes(line[colon + 1..].trim_ascii()).expect("value");
            f.push_at(at..at + colon, value);
            at += line.len() + 1;
        }
        f
    }

    #[test]
    fn names_are_found_in_any_case_and_in_order() {
        let mut f = fields(b"Host: a\nX-Key: 1\nx-key: 2\nACCEPT: */*");
        assert_eq!(f.get("host").map(HeaderValue::as_bytes), Some(&b"a"[..]));
        assert_eq!(
            f.get(http::header::ACCEPT).map(HeaderValue::as_bytes),
            Some(&b"*/*"[..])
        );
        let keys: Vec<_> = f.get_all("X-KEY").map(HeaderValue::as_bytes).collect();
        assert_eq!(keys, [&b"1"[..], b"2"]);
        assert!(!f.contains_key("x-ke"));
        assert_eq!(
            f.remove("x-key").map(|v| v.as_bytes().to_vec()),
            Some(b"1".to_vec())
        );
        assert!(!f.contains_key("x-key"));
        let old = f.insert(http::header::HOST, HeaderValue::from_static("b"));
        assert_eq!(old.as_ref().map(HeaderValue::as_bytes), Some(&b"a"[..]));
        let all: Vec<_> = f
            .iter()
            .map(|(n, v)| (n.to_vec(), v.as_bytes().to_vec()))
            .collect();
        assert_eq!(
            all,
            [
                (b"ACCEPT".to_vec(), b"*/*".to_vec()),
                (b"host".to_vec(), b"b".to_vec())
            ]
        );
        let map = f.to_map();
        assert_eq!(
            map.get("accept").map(HeaderValue::as_bytes),
            Some(&b"*/*"[..])
        );
        assert_eq!(map.len(), 2);
    }

    #[test]
    fn debug_shows_only_the_fields_left() {
        let mut f = fields(b"X-Key: secret\nA: 1");
        f.remove("x-key");
        let shown = format!("{f:?}");
        assert!(
            !shown.contains("secret") && shown.contains("\"A\""),
            "{shown}"
        );
    }

    #[test]
    fn names_are_stripped_in_one_pass_in_any_case() {
        let mut f = fields(b"Connection: a\nA: 1\nB: 2\nc: 3");
        f.strip_where(|n| {
            ["a", "C", "connection"]
                .iter()
                .any(|d| d.as_bytes().eq_ignore_ascii_case(n))
        });
        let left: Vec<_> = f.names().collect();
        assert_eq!(left, [&b"B"[..]]);
    }

    #[test]
    fn a_map_keeps_every_value_of_a_name() {
        let mut map = HeaderMap::new();
        map.append("a", HeaderValue::from_static("1"));
        map.append("a", HeaderValue::from_static("2"));
        map.append("b", HeaderValue::from_static("3"));
        let f = Fields::from(map);
        assert_eq!(f.len(), 3);
        assert_eq!(f.get_all("a").count(), 2);
        assert!(Lines::first(&f, "B").is_some());
    }
}
