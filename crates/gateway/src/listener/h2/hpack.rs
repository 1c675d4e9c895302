//! HPACK (RFC 7541) for the HTTP/2 server: a decoder with its dynamic table for requests,
//! and an encoder that sends answers as literals (static-table names where there is one,
//! no dynamic table, no Huffman): the cheapest encoding to make, a few bytes longer.
//!
//! Decoded fields keep their parsed `http` types in the dynamic table, so a field the
//! client sends again by index costs a reference count, not a parse.

use super::huffman;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use std::collections::VecDeque;
use std::sync::OnceLock;

/// A pseudo-header field's name (RFC 9113 §8.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pseudo {
    Authority,
    Method,
    Path,
    Scheme,
    /// `:status`, `:protocol` or an unknown one: never valid in a request here.
    Other,
}

/// One decoded field.
#[derive(Debug, Clone)]
pub enum Field {
    /// A pseudo-header field and its raw value.
    Pseudo(Pseudo, Bytes),
    /// A regular field with a valid lowercase name and a valid value.
    Header(HeaderName, HeaderValue),
    /// A field whose name or value HTTP/2 does not allow (uppercase, control bytes): it
    /// makes its request malformed. Decoded anyway to keep the table in step.
    Malformed,
}

/// A decoding failure: a connection error (COMPRESSION_ERROR).
#[derive(Debug, PartialEq, Eq)]
pub struct CompressionError;

/// A table entry: its field, its name on its own (a literal may reuse the name of a
/// malformed field with a good value), and the sizes HPACK counts.
#[derive(Debug, Clone)]
struct Entry {
    field: Field,
    name: NameOf,
    name_len: usize,
    /// Name + value + 32 (RFC 7541 §4.1).
    size: usize,
}

/// The request decoder of one connection.
pub struct Decoder {
    table: VecDeque<Entry>,
    size: usize,
    /// The size the table may have now (set by size updates).
    max: usize,
    /// The size our SETTINGS allow (HPACK's default: 4096).
    limit: usize,
    /// Scratch for Huffman-decoded strings.
    scratch: Vec<u8>,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max: 4096,
            limit: 4096,
            scratch: Vec::new(),
        }
    }
}

/// What one header block decoded to.
pub struct Decoded {
    /// The fields, in order.
    pub fields: Vec<Field>,
    /// The header list's size (RFC 9113 §6.5.2) went past the given limit; `fields` then
    /// stops where it did.
    pub too_large: bool,
    /// Bytes of the fields sent as literals: what the request holds of its own, beyond
    /// references to entries of the table.
    pub held: usize,
}

impl Decoder {
    /// Decodes one whole header block; the header list may be `max_list` bytes at most.
    pub fn decode(&mut self, block: Bytes, max_list: usize) -> Result<Decoded, CompressionError> {
        let mut fields = Vec::with_capacity(12);
        let mut list = 0usize;
        let mut too_large = false;
        let mut at = 0usize;
        let mut any_field = false;
        let mut held = 0usize;
        while at < block.len() {
            let b = block[at];
            let (field, size) = if b & 0x80 != 0 {
                let i = integer(&block, &mut at, 7)?;
                let e = self.get(i)?;
                if too_large {
                    // Past the limit a reference is checked, not copied: a block of
                    // one-byte references to one large entry costs no more than its bytes.
                    continue;
                }
                (e.field.clone(), e.size)
            } else if b & 0xe0 == 0x20 {
                // A table size update: only before the block's first field (RFC 7541 §4.2).
                let n = integer(&block, &mut at, 5)?;
                if any_field || n > self.limit {
                    return Err(CompressionError);
                }
                self.max = n;
                self.evict(0);
                continue;
            } else {
                let (prefix, index) = if b & 0xc0 == 0x40 {
                    (6, true)
                } else {
                    (4, false)
                };
                let i = integer(&block, &mut at, prefix)?;
                let (name, name_len) = if i == 0 {
                    let raw = self.string(&block, &mut at)?;
                    let len = raw.len();
                    held += len;
                    (parse_name(raw), len)
                } else {
                    let e = self.get(i)?;
                    (e.name.clone(), e.name_len)
                };
                let value = self.string(&block, &mut at)?;
                held += value.len();
                let size = name_len + value.len() + 32;
                let field = make(name.clone(), value);
                if index {
                    self.insert(Entry {
                        field: field.clone(),
                        name,
                        name_len,
                        size,
                    });
                }
                (field, size)
            };
            any_field = true;
            if too_large {
                continue;
            }
            list += size;
            if list > max_list {
                too_large = true;
            } else {
                fields.push(field);
            }
        }
        Ok(Decoded {
            fields,
            too_large,
            held,
        })
    }

    fn get(&self, i: usize) -> Result<&Entry, CompressionError> {
        match i {
            0 => Err(CompressionError),
            1..=61 => Ok(&statics()[i - 1]),
            _ => self.table.get(i - 62).ok_or(CompressionError),
        }
    }

    fn insert(&mut self, e: Entry) {
        if e.size > self.max {
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict(e.size);
        self.size += e.size;
        self.table.push_front(e);
    }

    /// Evicts the oldest entries until `room` more bytes fit.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max {
            match self.table.pop_back() {
                Some(e) => self.size -= e.size,
                None => break,
            }
        }
    }

    /// A string literal (RFC 7541 §5.2): a slice of the block, or Huffman-decoded.
    fn string(&mut self, block: &Bytes, at: &mut usize) -> Result<Bytes, CompressionError> {
        let huff = *block.get(*at).ok_or(CompressionError)? & 0x80 != 0;
        let len = integer(block, at, 7)?;
        let end = at.checked_add(len).ok_or(CompressionError)?;
        if end > block.len() {
            return Err(CompressionError);
        }
        let raw = &block[*at..end];
        // Always a copy: a slice would keep the whole read buffer it came in alive for as
        // long as the request (or the table's entry) holds it, a buffer of 16 KiB or more
        // for a value of a few bytes.
        let out = if huff {
            self.scratch.clear();
            huffman::decode(raw, &mut self.scratch).map_err(|_| CompressionError)?;
            Bytes::copy_from_slice(&self.scratch)
        } else {
            Bytes::copy_from_slice(raw)
        };
        *at = end;
        Ok(out)
    }
}

/// A field's name, parsed once.
#[derive(Debug, Clone)]
enum NameOf {
    Pseudo(Pseudo),
    Header(HeaderName),
    Bad,
}

fn parse_name(raw: Bytes) -> NameOf {
    if let Some(p) = raw.strip_prefix(b":") {
        return NameOf::Pseudo(match p {
            b"authority" => Pseudo::Authority,
            b"method" => Pseudo::Method,
            b"path" => Pseudo::Path,
            b"scheme" => Pseudo::Scheme,
            _ => Pseudo::Other,
        });
    }
    // HTTP/2 names are lowercase: an uppercase one makes the request malformed (RFC 9113
    // §8.2.1), where `HeaderName::from_bytes` would lowercase it.
    match HeaderName::from_lowercase(&raw) {
        Ok(n) => NameOf::Header(n),
        Err(_) => NameOf::Bad,
    }
}

fn make(name: NameOf, value: Bytes) -> Field {
    match name {
        NameOf::Pseudo(p) => Field::Pseudo(p, value),
        NameOf::Header(n) => {
            // No leading or trailing white space either (RFC 9113 §8.2.1).
            let edge = |b: Option<&u8>| matches!(b, Some(b' ' | b'\t'));
            if edge(value.first()) || edge(value.last()) {
                return Field::Malformed;
            }
            match HeaderValue::from_maybe_shared(value) {
                Ok(v) => Field::Header(n, v),
                Err(_) => Field::Malformed,
            }
        }
        NameOf::Bad => Field::Malformed,
    }
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 §5.1), at most 2^28.
fn integer(block: &[u8], at: &mut usize, n: u32) -> Result<usize, CompressionError> {
    let mask = (1usize << n) - 1;
    let first = *block.get(*at).ok_or(CompressionError)? as usize & mask;
    *at += 1;
    if first < mask {
        return Ok(first);
    }
    let mut value = mask;
    let mut shift = 0u32;
    loop {
        let b = *block.get(*at).ok_or(CompressionError)?;
        *at += 1;
        value += ((b & 0x7f) as usize) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
        shift += 7;
        if shift > 21 {
            return Err(CompressionError);
        }
    }
}

/// The static table (RFC 7541 Appendix A).
fn statics() -> &'static [Entry] {
    static TABLE: OnceLock<Vec<Entry>> = OnceLock::new();
    TABLE.get_or_init(|| {
        STATIC
            .iter()
            .map(|(name, value)| {
                let parsed = parse_name(Bytes::from_static(name.as_bytes()));
                Entry {
                    field: make(parsed.clone(), Bytes::from_static(value.as_bytes())),
                    name: parsed,
                    name_len: name.len(),
                    size: name.len() + value.len() + 32,
                }
            })
            .collect()
    })
}

const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// Writes an HPACK integer with an `n`-bit prefix whose other bits are `first`.
fn put_integer(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let mask = (1usize << n) - 1;
    if v < mask {
        out.push(first | v as u8);
        return;
    }
    out.push(first | mask as u8);
    v -= mask;
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    put_integer(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// Encodes `:status`: indexed where the static table has it.
pub fn encode_status(out: &mut Vec<u8>, status: http::StatusCode) {
    let index = match status.as_u16() {
        200 => 8,
        204 => 9,
        206 => 10,
        304 => 11,
        400 => 12,
        404 => 13,
        500 => 14,
        _ => 0,
    };
    if index != 0 {
        out.push(0x80 | index);
    } else {
        // Literal without indexing, name `:status` (index 8).
        out.push(0x08);
        put_string(out, status.as_str().as_bytes());
    }
}

/// Encodes one field as a literal without indexing (never indexed when `sensitive`).
pub fn encode_field(out: &mut Vec<u8>, name: &HeaderName, value: &HeaderValue) {
    let first = if value.is_sensitive() { 0x10 } else { 0x00 };
    match static_name(name.as_str()) {
        Some(i) => put_integer(out, first, 4, i),
        None => {
            out.push(first);
            put_string(out, name.as_str().as_bytes());
        }
    }
    put_string(out, value.as_bytes());
}

/// The static-table index of an answer's common field names.
fn static_name(name: &str) -> Option<usize> {
    Some(match name {
        "content-type" => 31,
        "content-length" => 28,
        "date" => 33,
        "server" => 54,
        "cache-control" => 24,
        "etag" => 34,
        "vary" => 59,
        "location" => 46,
        "set-cookie" => 55,
        "www-authenticate" => 61,
        "retry-after" => 53,
        "access-control-allow-origin" => 20,
        "age" => 21,
        "allow" => 22,
        "content-encoding" => 26,
        "expires" => 36,
        "last-modified" => 44,
        "via" => 60,
        "accept-ranges" => 18,
        "content-range" => 30,
        "link" => 45,
        "strict-transport-security" => 56,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(d: &Decoded) -> Vec<String> {
        d.fields
            .iter()
            .map(|f| match f {
                Field::Pseudo(p, v) => format!("{p:?}={}", String::from_utf8_lossy(v)),
                Field::Header(n, v) => format!("{n}={}", v.to_str().unwrap_or("?")),
                Field::Malformed => "malformed".into(),
            })
            .collect()
    }

    #[test]
    fn decodes_the_rfc_request_examples_in_sequence() {
        // RFC 7541 C.4: three requests with Huffman coding, sharing one table.
        let mut d = Decoder::default();
        let one = [
            0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab,
            0x90, 0xf4, 0xff,
        ];
        let got = d.decode(Bytes::copy_from_slice(&one), 1 << 16).expect("ok");
        assert_eq!(
            names(&got),
            [
                "Method=GET",
                "Scheme=http",
                "Path=/",
                "Authority=www.example.com"
            ]
        );
        let two = [
            0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf,
        ];
        let got = d.decode(Bytes::copy_from_slice(&two), 1 << 16).expect("ok");
        assert_eq!(
            names(&got)[3..],
            ["Authority=www.example.com", "cache-control=no-cache"]
        );
        assert_eq!(d.size, 110);
        // An index past the table, and a size update after a field.
        assert_eq!(
            d.decode(Bytes::from_static(&[0xff, 0x00]), 1 << 16).err(),
            Some(CompressionError)
        );
        assert_eq!(
            d.decode(Bytes::from_static(&[0x82, 0x20]), 1 << 16).err(),
            Some(CompressionError)
        );
        // A list past the limit is reported, and the table still follows the block.
        let got = d.decode(Bytes::copy_from_slice(&two), 60).expect("ok");
        assert!(got.too_large);
        // Past the limit, references are still checked: one past the table is an error.
        let mut refs = vec![0x82; 100];
        let got = d.decode(Bytes::from(refs.clone()), 100).expect("ok");
        assert!(got.too_large);
        assert!(got.fields.len() < 100);
        refs.extend([0xff, 0x00]);
        assert_eq!(
            d.decode(Bytes::from(refs), 100).err(),
            Some(CompressionError)
        );
    }

    #[test]
    fn uppercase_names_and_bad_values_are_malformed_fields() {
        let mut d = Decoder::default();
        // Literal without indexing, new name "X-A" = "v"; then "x-a" = " v".
        let block = [
            0x00, 0x03, b'X', b'-', b'A', 0x01, b'v', 0x00, 0x03, b'x', b'-', b'a', 0x02, b' ',
            b'v',
        ];
        let got = d
            .decode(Bytes::copy_from_slice(&block), 1 << 16)
            .expect("ok");
        assert_eq!(names(&got), ["malformed", "malformed"]);
    }

    #[test]
    fn a_name_reused_from_a_malformed_field_keeps_the_table_in_step() {
        let mut d = Decoder::default();
        // Indexed: "x-a" = " v" (malformed: leading space), then the same name (index 62)
        // with "ok", indexed too. Both entries are 37 bytes, as the client counts them.
        let block = [
            0x40,
            0x03,
            b'x',
            b'-',
            b'a',
            0x02,
            b' ',
            b'v',
            0x40 | 62,
            0x02,
            b'o',
            b'k',
        ];
        let got = d
            .decode(Bytes::copy_from_slice(&block), 1 << 16)
            .expect("ok");
        assert_eq!(names(&got), ["malformed", "x-a=ok"]);
        assert_eq!(d.size, 74);
    }

    #[test]
    fn encodes_what_it_decodes() {
        let mut out = Vec::new();
        encode_status(&mut out, http::StatusCode::UNAUTHORIZED);
        encode_field(
            &mut out,
            &http::header::CONTENT_TYPE,
            &HeaderValue::from_static("application/json"),
        );
        encode_field(
            &mut out,
            &HeaderName::from_static("x-request-id"),
            &HeaderValue::from_static("abc"),
        );
        let mut d = Decoder::default();
        let got = d.decode(Bytes::from(out), 1 << 16).expect("ok");
        // `:status` is no request field: decoded as `Other`.
        assert_eq!(
            names(&got),
            [
                "Other=401",
                "content-type=application/json",
                "x-request-id=abc"
            ]
        );
        let mut long = Vec::new();
        put_integer(&mut long, 0, 5, 1337);
        assert_eq!(long, [0x1f, 0x9a, 0x0a]);
    }
}
