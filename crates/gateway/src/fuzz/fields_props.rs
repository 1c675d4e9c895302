//! `Fields` held to `http::HeaderMap` on random heads and random edits: the same values for
//! every name in any case, whatever was removed, set or stripped on the way.

use super::props::spelled;
use crate::exchange::{Fields, Lines};
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use proptest::prelude::*;

/// Names that meet the request path's cases: framing, hop-by-hop, owned, and plain ones.
const NAMES: [&str; 8] = [
    "host",
    "content-length",
    "connection",
    "x-consumer",
    "x-forwarded-for",
    "te",
    "x-a",
    "accept",
];

#[derive(Debug, Clone)]
enum Edit {
    Remove(usize, u32),
    Insert(usize, u8),
    Append(usize, u8),
    Strip(Vec<(usize, u32)>),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (0..NAMES.len(), any::<u32>()).prop_map(|(i, m)| Edit::Remove(i, m)),
        (0..NAMES.len(), any::<u8>()).prop_map(|(i, v)| Edit::Insert(i, v)),
        (0..NAMES.len(), any::<u8>()).prop_map(|(i, v)| Edit::Append(i, v)),
        prop::collection::vec((0..NAMES.len(), any::<u32>()), 0..4).prop_map(Edit::Strip),
    ]
}

/// The values of every name, in order, read in a case chosen by `mask`.
fn values_of(f: &Fields, mask: u32) -> Vec<Vec<Vec<u8>>> {
    (0..NAMES.len())
        .map(|i| {
            f.get_all(spelled(&NAMES, i, mask))
                .map(|v| v.as_bytes().to_vec())
                .collect()
        })
        .collect()
}

fn map_values(m: &HeaderMap) -> Vec<Vec<Vec<u8>>> {
    NAMES
        .iter()
        .map(|n| {
            m.get_all(*n)
                .iter()
                .map(|v| v.as_bytes().to_vec())
                .collect()
        })
        .collect()
}

proptest! {
    #[test]
    fn fields_read_and_edit_as_a_map_does(
        head in prop::collection::vec((0..NAMES.len(), any::<u32>(), 0u8..4), 0..12),
        edits in prop::collection::vec(edit(), 0..8),
        mask in any::<u32>(),
    ) {
        // The head as written, and the same fields in a map.
        let mut text = String::new();
        let mut spans = Vec::new();
        let mut map = HeaderMap::new();
        for (i, m, v) in &head {
            let name = spelled(&NAMES, *i, *m);
            spans.push((text.len(), text.len() + name.len(), *v));
            text.push_str(&name);
            text.push_str(": ");
            text.push_str(&v.to_string());
            text.push_str("\r\n");
            map.append(NAMES[*i], HeaderValue::from(u16::from(*v)));
        }
        let bytes = Bytes::from(text);
        let mut fields = Fields::in_head(bytes, spans.len());
        for (a, b, v) in spans {
            fields.push_at(a..b, HeaderValue::from(u16::from(v)));
        }
        prop_assert_eq!(values_of(&fields, mask), map_values(&map));
        for e in edits {
            match e {
                Edit::Remove(i, m) => {
                    let got = fields.remove(spelled(&NAMES, i, m));
                    prop_assert_eq!(got, map.remove(NAMES[i]));
                }
                Edit::Insert(i, v) => {
                    let name = HeaderName::from_static(NAMES[i]);
                    let got = fields.insert(name.clone(), HeaderValue::from(u16::from(v)));
                    prop_assert_eq!(got, map.insert(name, HeaderValue::from(u16::from(v))));
                }
                Edit::Append(i, v) => {
                    let name = HeaderName::from_static(NAMES[i]);
                    fields.append(name.clone(), HeaderValue::from(u16::from(v)));
                    map.append(name, HeaderValue::from(u16::from(v)));
                }
                Edit::Strip(names) => {
                    // Spelled in any case, as a client's `Connection` names them.
                    let spelled: Vec<String> = names.iter().map(|(i, m)| spelled(&NAMES, *i, *m)).collect();
                    let named = |n: &[u8]| spelled.iter().any(|s| s.as_bytes().eq_ignore_ascii_case(n));
                    fields.strip_where(named);
                    map.strip_where(named);
                }
            }
            prop_assert_eq!(values_of(&fields, mask), map_values(&map));
            prop_assert_eq!(fields.len(), map.len());
        }
        prop_assert_eq!(map_values(&fields.to_map()), map_values(&map));
    }
}
