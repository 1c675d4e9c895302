//! Property tests of the same parsers: normalization, the HPACK encoder against the
//! decoder, the access log's JSON strings against serde_json's, and the CORS echo of a
//! preflight's header list without `Authorization`.

use super::inbound::{check_host, check_path};
use crate::listener::h2::hpack::{self, Decoder, Field};
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::StatusCode;

use proptest::prelude::*;

/// The name `i` picks of `names` (wrapping), in the case `mask` picks ([`in_case`]).
pub(super) fn spelled(names: &[&str], i: usize, mask: u32) -> String {
    in_case(names[i % names.len()], mask)
}

/// `name` with the letters `mask` picks (bit i for letter i) upper-cased: a header name
/// as a client may spell it.
fn in_case(name: &str, mask: u32) -> String {
    name.chars()
        .enumerate()
        .map(|(k, c)| {
            if mask >> (k % 32) & 1 == 1 {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect()
}

/// Path pieces that meet the normalizer's cases: dots, parameters, escapes, slashes.
fn path() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(vec![
        "/",
        "/",
        "a",
        "b~",
        ".",
        "..",
        ";",
        ";x=1",
        "%2e",
        "%2E",
        "%2f",
        "%5c",
        "%00",
        "%25",
        "%41",
        "%7e",
        "%e2%82%ac",
        "%",
        "%g1",
        "\\",
        "//",
        "é",
        "?",
        "#",
        "*",
    ]);
    prop_oneof![
        prop::collection::vec(piece, 0..16).prop_map(|p| p.concat()),
        any::<String>().prop_map(|s| format!("/{s}")),
    ]
}

/// A regular field HTTP/2 allows: a lowercase name and a value without edge white space.
fn field() -> impl Strategy<Value = (HeaderName, HeaderValue, bool)> {
    let name = prop_oneof![
        prop::sample::select(vec![
            "content-type",
            "content-length",
            "date",
            "server",
            "cache-control",
            "etag",
            "set-cookie",
            "www-authenticate",
            "via",
            "link",
            "x-request-id",
        ])
        .prop_map(String::from),
        "[a-z0-9!#$%&'*+.^_`|~-]{1,24}",
    ];
    let value = prop::collection::vec(prop_oneof![0x20u8..0x7f, Just(b'\t'), 0x80u8..=0xff], 0..64)
        .prop_map(|v| {
            let edge = |b: &u8| *b == b' ' || *b == b'\t';
            let start = v.iter().position(|b| !edge(b)).unwrap_or(v.len());
            let end = v.iter().rposition(|b| !edge(b)).map_or(start, |e| e + 1);
            v[start..end].to_vec()
        });
    (name, value, any::<bool>()).prop_filter_map("a valid field", |(n, v, s)| {
        let n = HeaderName::from_lowercase(n.as_bytes()).ok()?;
        let mut v = HeaderValue::from_bytes(&v).ok()?;
        v.set_sensitive(s);
        Some((n, v, s))
    })
}

/// serde_json's string escapes, with `\b` and `\f` written as `\u00XX` as the
/// access log writes them: both are valid JSON for the same string.
struct LogEscapes;

impl serde_json::ser::Formatter for LogEscapes {
    fn write_char_escape<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        e: serde_json::ser::CharEscape,
    ) -> std::io::Result<()> {
        use serde_json::ser::CharEscape;
        match e {
            CharEscape::Backspace => w.write_all(b"\\u0008"),
            CharEscape::FormFeed => w.write_all(b"\\u000c"),
            other => serde_json::ser::CompactFormatter.write_char_escape(w, other),
        }
    }
}

fn serde_escaped(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, LogEscapes);
    serde::Serialize::serialize(s, &mut ser).expect("a string serializes");
    out
}

proptest! {
    #[test]
    fn normalized_paths_are_fixed_points_without_dot_segments(p in path()) {
        check_path(&p);
    }

    #[test]
    fn accepted_hosts_hold_no_second_authority(h in "[a-zA-Z0-9.:\\[\\]@%/_-]{0,24}") {
        check_host(&h);
    }

    #[test]
    fn hpack_encoded_fields_decode_to_themselves(
        blocks in prop::collection::vec(
            (100u16..1000, prop::collection::vec(field(), 0..12)),
            1..4,
        )
    ) {
        let mut decoder = Decoder::default();
        for (status, fields) in blocks {
            let status = StatusCode::from_u16(status).expect("100..1000");
            let mut out = Vec::new();
            hpack::encode_status(&mut out, status);
            for (n, v, _) in &fields {
                hpack::encode_field(&mut out, n, v);
            }
            let got = decoder.decode(Bytes::from(out), usize::MAX).expect("decodes");
            prop_assert!(!got.too_large);
            prop_assert_eq!(got.fields.len(), fields.len() + 1);
            match &got.fields[0] {
                Field::Pseudo(hpack::Pseudo::Other, v) => {
                    prop_assert_eq!(&v[..], status.as_str().as_bytes());
                }
                _ => prop_assert!(false, "not :status"),
            }
            for (got, (n, v, _)) in got.fields[1..].iter().zip(&fields) {
                match got {
                    Field::Header(gn, gv) => {
                        prop_assert_eq!(gn, n);
                        prop_assert_eq!(gv, v);
                    }
                    _ => prop_assert!(false, "{n}: {v:?} came back malformed"),
                }
            }
        }
    }

    #[test]
    fn an_echoed_preflight_list_never_holds_authorization(
        names in prop::collection::vec((0usize..6, any::<u32>(), " {0,2}", ",{1,2}"), 0..6)
    ) {
        let all = ["authorization", "x-a", "content-type", "authorization ", "", "x-authorization"];
        let asked: String = names
            .iter()
            .map(|(i, mask, pad, sep)| format!("{pad}{}{sep}", spelled(&all, *i, *mask)))
            .collect();
        let v = HeaderValue::from_str(&asked).expect("visible ASCII");
        let given: Vec<String> = asked
            .split(',')
            .map(|n| n.trim().to_ascii_lowercase())
            .collect();
        if let Some(kept) = crate::policy::cors::but_authorization(&v, false) {
            for n in kept.to_str().expect("ASCII").split(", ") {
                prop_assert!(!n.eq_ignore_ascii_case("authorization"), "{asked:?}");
                prop_assert!(!n.is_empty(), "{asked:?}");
                prop_assert!(given.contains(&n.to_ascii_lowercase()), "{n:?} of {asked:?}");
            }
        } else {
            prop_assert!(given.iter().all(|n| n.is_empty() || n == "authorization"), "{asked:?}");
        }
    }

    #[test]
    fn log_strings_escape_as_serde_json_does(
        s in prop_oneof![
            any::<String>(),
            prop::collection::vec(prop::char::range('\0', '\u{7f}'), 0..40)
                .prop_map(|c| c.into_iter().collect::<String>()),
        ]
    ) {
        let mut out = Vec::new();
        crate::observe::access_log::escape(&mut out, &s);
        let want = serde_escaped(&s);
        prop_assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(&want));
        let back: String = serde_json::from_slice(&out).expect("valid JSON");
        prop_assert_eq!(back, s);
    }
}
