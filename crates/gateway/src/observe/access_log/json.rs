//! One record as one line of JSON: fixed decimals, escapes only where needed, time read
//! once per batch.

use crate::observe::record::Record;
use crate::observe::request_id::hex32;
use http::HeaderValue;
use std::time::{Duration, SystemTime};

fn text(v: &HeaderValue) -> &str {
    std::str::from_utf8(v.as_bytes()).unwrap_or("")
}

/// Writes JSON lines by hand: the writer's whole job, so it is worth not going through a
/// generic serializer (serde_json cost about 3,000 instructions a line in escaping alone).
/// Each member is written with its key, quotes and separator as one static piece.
struct Json<'a> {
    out: &'a mut Vec<u8>,
}

impl Json<'_> {
    /// A string member that may need escaping (`key` is `,"name":`).
    #[inline(always)]
    fn str(&mut self, key: &[u8], v: Option<&str>) {
        self.out.extend_from_slice(key);
        match v {
            Some(v) => escape(self.out, v),
            None => self.out.extend_from_slice(b"null"),
        }
    }

    /// A string member known to need no escaping: validated ids, addresses, names the
    /// config checked, the gateway's own words.
    #[inline(always)]
    fn plain(&mut self, key: &[u8], v: Option<&[u8]>) {
        self.out.extend_from_slice(key);
        match v {
            Some(v) => {
                self.out.push(b'"');
                self.out.extend_from_slice(v);
                self.out.push(b'"');
            }
            None => self.out.extend_from_slice(b"null"),
        }
    }

    /// The target without the parameters that carry keys (`redact`), written as it is
    /// cut: no copy of the cut target is made.
    fn target(&mut self, key: &[u8], target: &str, redact: &[String]) {
        self.out.extend_from_slice(key);
        self.out.push(b'"');
        match target.bytes().position(|b| b == b'?') {
            Some(i) if !redact.is_empty() => {
                escape_into(self.out, &target[..i]);
                let out = &mut *self.out;
                crate::query::kept_pieces(&target[i + 1..], redact, |sep, piece| {
                    out.push(sep);
                    escape_into(out, piece);
                });
            }
            _ => escape_into(self.out, target),
        }
        self.out.push(b'"');
    }

    #[inline(always)]
    fn num(&mut self, key: &[u8], v: Option<u64>) {
        self.out.extend_from_slice(key);
        match v {
            Some(v) => self
                .out
                .extend_from_slice(itoa::Buffer::new().format(v).as_bytes()),
            None => self.out.extend_from_slice(b"null"),
        }
    }

    /// Nanoseconds as milliseconds with three decimals (whole microseconds).
    #[inline(always)]
    fn ms(&mut self, key: &[u8], ns: Option<u64>) {
        self.out.extend_from_slice(key);
        let Some(ns) = ns else {
            self.out.extend_from_slice(b"null");
            return;
        };
        let us = ns.saturating_add(500) / 1_000;
        self.out
            .extend_from_slice(itoa::Buffer::new().format(us / 1_000).as_bytes());
        let frac = us % 1_000;
        self.out.extend_from_slice(&[
            b'.',
            b'0' + u8::try_from(frac / 100).unwrap_or(0),
            b'0' + u8::try_from(frac / 10 % 10).unwrap_or(0),
            b'0' + u8::try_from(frac % 10).unwrap_or(0),
        ]);
    }
}

/// Whether a byte must be escaped in a JSON string.
fn needs_escape(c: u8) -> bool {
    c < 0x20 || c == b'"' || c == b'\\'
}

/// Whether any byte of `b` must be escaped, eight bytes at a time: a byte below 0x20, a
/// quote or a backslash (bytes of 0x80 and above are UTF-8 and pass).
fn any_needs_escape(b: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // A byte of `x` is below `n` (n <= 0x80): the classic exact "has less" test.
    let below = |x: u64, n: u64| x.wrapping_sub(ONES * n) & !x & HIGH;
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        let x = u64::from_le_bytes(w);
        if below(x, 0x20) | below(x ^ (ONES * 0x22), 1) | below(x ^ (ONES * 0x5c), 1) != 0 {
            return true;
        }
    }
    chunks.remainder().iter().any(|&c| needs_escape(c))
}

/// A JSON string: quoted, with `"`, `\\` and control characters escaped.
pub(crate) fn escape(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    escape_into(out, s);
    out.push(b'"');
}

/// The inside of a JSON string: `s` with `"`, `\\` and control characters escaped.
fn escape_into(out: &mut Vec<u8>, s: &str) {
    let b = s.as_bytes();
    let plain = !any_needs_escape(b);
    if plain {
        out.extend_from_slice(b);
    } else {
        for &c in b {
            match c {
                b'"' => out.extend_from_slice(b"\\\""),
                b'\\' => out.extend_from_slice(b"\\\\"),
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => out.extend_from_slice(b"\\r"),
                b'\t' => out.extend_from_slice(b"\\t"),
                c if c < 0x20 => {
                    const HEX: &[u8; 16] = b"0123456789abcdef";
                    out.extend_from_slice(b"\\u00");
                    out.push(HEX[usize::from(c >> 4)]);
                    out.push(HEX[usize::from(c & 0xf)]);
                }
                c => out.push(c),
            }
        }
    }
}

/// The RFC 3339 time of a line, made once a second and completed with milliseconds.
#[derive(Default)]
pub(super) struct Clock {
    second: u64,
    prefix: String,
}

impl Clock {
    fn write(&mut self, wall_ns: u64, out: &mut Vec<u8>) {
        let second = wall_ns / 1_000_000_000;
        if self.prefix.is_empty() || second != self.second {
            let t = SystemTime::UNIX_EPOCH + Duration::from_secs(second);
            // `2026-11-22T18:55:39Z` without its `Z`.
            let mut p = humantime::format_rfc3339_seconds(t).to_string();
            p.pop();
            self.prefix = p;
            self.second = second;
        }
        out.push(b'"');
        out.extend_from_slice(self.prefix.as_bytes());
        let ms = wall_ns / 1_000_000 % 1_000;
        out.extend_from_slice(&[
            b'.',
            b'0' + u8::try_from(ms / 100).unwrap_or(0),
            b'0' + u8::try_from(ms / 10 % 10).unwrap_or(0),
            b'0' + u8::try_from(ms % 10).unwrap_or(0),
            b'Z',
            b'"',
        ]);
    }
}

/// Writes `rec`'s line; it arrived at `arrived_ns` (wall clock, since the epoch).
pub(super) fn write_line(rec: &Record, arrived_ns: u64, clock: &mut Clock, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"time\":");
    clock.write(arrived_ns, out);
    let mut j = Json { out };
    // Ids are validated to need no escaping; addresses, methods, limit names and targets
    // cannot hold a quote or a backslash.
    j.plain(b",\"request_id\":", Some(&rec.request_id));
    let trace_id = rec
        .trace
        .as_ref()
        .map(|t| hex32(u128::from_be_bytes(t.trace_id.to_bytes())));
    j.plain(b",\"trace_id\":", trace_id.as_ref().map(|t| &t[..]));
    j.plain(b",\"client\":", Some(rec.client.as_bytes()));
    j.plain(b",\"method\":", Some(rec.method.as_str().as_bytes()));
    // A routed target is a copy of a `&str`; one refused before its head parsed may hold
    // other bytes, logged as U+FFFD rather than lost.
    let uri = String::from_utf8_lossy(&rec.uri);
    j.target(b",\"path\":", &uri, rec.snap.credential_params());
    j.str(b",\"route\":", rec.route.as_deref());
    j.str(
        b",\"consumer\":",
        rec.consumer.map(|c| rec.snap.consumer_name(c)),
    );
    j.num(b",\"status\":", Some(u64::from(rec.status)));
    j.num(b",\"bytes_in\":", rec.bytes_in);
    j.num(b",\"bytes_out\":", Some(rec.bytes_out));
    j.ms(
        b",\"duration_ms\":",
        Some(u64::try_from(rec.duration.as_nanos()).unwrap_or(u64::MAX)),
    );
    j.ms(b",\"upstream_ms\":", rec.upstream_ns);
    j.plain(
        b",\"upstream_target\":",
        rec.target.as_deref().map(str::as_bytes),
    );
    j.plain(b",\"refusal\":", rec.refusal.map(str::as_bytes));
    j.plain(b",\"limit\":", rec.limit.as_deref().map(str::as_bytes));
    j.str(b",\"cache\":", rec.cache.as_ref().map(text));
    j.out.extend_from_slice(b"}\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::record::Names;
    use http::{HeaderValue, Method};
    use smallvec::SmallVec;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn the_word_test_for_escapes_agrees_with_the_byte_test() {
        let mut cases: Vec<Vec<u8>> = vec![Vec::new(), b"/plain/path?x=1&y=2".to_vec()];
        for bad in [0u8, 0x1f, b'"', b'\\', b'\n'] {
            for at in 0..20 {
                let mut v = b"abcdefghijklmnopqrst".to_vec();
                v[at] = bad;
                cases.push(v);
            }
        }
        // Bytes next to the limits, and UTF-8 (high bit set), never need escaping.
        cases.push(vec![
            0x20, 0x21, 0x23, 0x5b, 0x5d, 0x7f, 0x80, 0xff, 0xc3, 0xa9,
        ]);
        for c in &cases {
            assert_eq!(
                any_needs_escape(c),
                c.iter().any(|&b| needs_escape(b)),
                "{c:?}"
            );
        }
    }

    #[test]
    fn lines_are_json_with_escapes_and_fixed_decimals() {
        #[derive(Debug)]
        struct Snap;
        impl Names for Snap {
            fn consumer_name(&self, _: usize) -> &str {
                "c\"1"
            }
            fn credential_params(&self) -> &[String] {
                static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
                NAMES.get_or_init(|| vec!["ApiKey".to_string()])
            }
        }
        let snap = Arc::new(Snap);
        let mut rec = Record {
            start: Instant::now(),
            request_id: SmallVec::from_slice(b"abc"),
            client: HeaderValue::from_static("10.0.0.7"),
            method: Method::GET,
            uri: SmallVec::from_slice(b"/p?x=1&apikey=s3cret;y=\""),
            snap,
            route: Some(Arc::from("r\"q")),
            consumer: Some(0),
            status: 200,
            bytes_in: None,
            bytes_out: 27,
            duration: Duration::from_nanos(1_234_567),
            upstream_ns: Some(5_000_400),
            target: None,
            refusal: None,
            limit: None,
            cache: None,
            trace: Some(crate::observe::trace::RequestTrace {
                trace_id: opentelemetry::trace::TraceId::from(
                    0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c,
                ),
                span_id: opentelemetry::trace::SpanId::from(7),
                sampled: false,
                parent: None,
                state: None,
                id_from_request: false,
            }),
            span_head: None,
            retries: 0,
        };
        let mut out = Vec::new();
        write_line(
            &rec,
            1_795_375_742_123_456_789,
            &mut Clock::default(),
            &mut out,
        );
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["time"], "2026-11-22T19:29:02.123Z");
        assert_eq!(v["path"], "/p?x=1;y=\"");
        assert_eq!(v["route"], "r\"q");
        assert_eq!(v["trace_id"], "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(v["consumer"], "c\"1");
        assert_eq!(v["limit"], serde_json::Value::Null);
        assert_eq!(v["duration_ms"], 1.235);
        assert_eq!(v["upstream_ms"], 5.0);
        assert_eq!(v["bytes_in"], serde_json::Value::Null);
        assert!(text.contains("\"upstream_ms\":5.000,"), "{text}");

        // A target refused before its head parsed may not be UTF-8: kept, not emptied.
        rec.uri = SmallVec::from_slice(b"/a\xffb?apikey=s");
        let mut out = Vec::new();
        write_line(&rec, 0, &mut Clock::default(), &mut out);
        let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["path"], "/a\u{fffd}b");
    }
}
