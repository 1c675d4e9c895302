//! The hop-by-hop strip held to a plain model on random heads: every name lower-cased,
//! then the fixed names and the listed ones dropped, the protected ones kept.

use super::props::spelled;
use crate::exchange::Fields;
use crate::inbound::{strip_hop_headers, Owned};
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use proptest::prelude::*;

/// Names that meet each case: fixed hop-by-hop, protected, owned, and plain ones.
const NAMES: [&str; 10] = [
    "connection",
    "keep-alive",
    "te",
    "upgrade",
    "host",
    "content-length",
    "x-consumer",
    "x_consumer",
    "x-a",
    "x-b",
];

const FIXED: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn owned() -> Owned {
    Owned {
        consumer_headers: vec![HeaderName::from_static("x-consumer")],
        dashed: vec!["x-consumer".to_string()],
    }
}

proptest! {
    #[test]
    fn the_strip_keeps_what_the_model_keeps(
        fields in prop::collection::vec((0..NAMES.len(), any::<u32>()), 0..10),
        listed in prop::collection::vec((0..NAMES.len(), any::<u32>(), 0u8..4), 0..20),
        high_byte in any::<bool>(),
    ) {
        // The Connection list: names in any case, some padded, some empty pieces.
        let mut list: Vec<String> = listed
            .iter()
            .map(|(i, m, pad)| match pad {
                0 => spelled(&NAMES, *i, *m),
                1 => format!(" {}\t", spelled(&NAMES, *i, *m)),
                2 => String::new(),
                _ => format!("x-n{i}"),
            })
            .collect();
        if high_byte {
            list.push("\u{e9}t\u{e9}".to_string());
        }
        let mut text = format!("Connection: {}\r\n", list.join(","));
        let mut spans = vec![(0, "Connection".len(), list.join(","))];
        for (n, (i, m)) in fields.iter().enumerate() {
            let name = spelled(&NAMES, *i, *m);
            spans.push((text.len(), text.len() + name.len(), n.to_string()));
            text.push_str(&format!("{name}: {n}\r\n"));
        }
        let head = Bytes::from(text);
        let mut h = Fields::in_head(head.clone(), spans.len());
        for (a, b, v) in &spans {
            let v = HeaderValue::from_bytes(v.as_bytes()).expect("value");
            h.push_at(*a..*b, v);
        }
        // The model: lower case everywhere.
        let dropped: Vec<String> = list
            .iter()
            .map(|n| n.trim().to_ascii_lowercase())
            .filter(|n| !n.is_empty() && !matches!(n.as_str(), "host" | "content-length" | "x-consumer" | "x_consumer"))
            .chain(FIXED.iter().map(|n| n.to_string()))
            .collect();
        let want: Vec<(String, String)> = spans
            .iter()
            .map(|(a, b, v)| (String::from_utf8_lossy(&head[*a..*b]).into_owned(), v.clone()))
            .filter(|(n, _)| !dropped.contains(&n.to_ascii_lowercase()))
            .collect();
        strip_hop_headers(&mut h, &owned());
        let got: Vec<(String, String)> = h
            .iter()
            .map(|(n, v)| (String::from_utf8_lossy(n).into_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .collect();
        prop_assert_eq!(got, want);
    }
}
