//! Tests of the lean client's parsing and encoding.

use super::*;

fn parse(raw: &str, method: Method) -> Parsed {
    parse_head(&BytesMut::from(raw), &method)
        .expect("valid")
        .expect("complete")
}

#[test]
fn values_are_read_whole_and_hop_by_hop_fields_noted() {
    let (h, _, _, _) = parse(
        "HTTP/1.1 200 OK\r\nX-A:  spaced value \r\nEmpty:\r\nX-B: b\r\n\r\n",
        Method::GET,
    );
    assert_eq!(h.headers["x-a"], "spaced value");
    assert_eq!(h.headers["empty"], "");
    assert_eq!(h.headers["x-b"], "b");
    assert!(h.plain, "nothing hop-by-hop");
    for hop in [
        "Connection: x",
        "keep-alive: 5",
        "TE: trailers",
        "Upgrade: h2c",
        "Trailer: x-sum",
        "Proxy-Connection: close",
        "Transfer-Encoding: chunked",
    ] {
        let raw = format!("HTTP/1.1 200 OK\r\nX-A: a\r\n{hop}\r\n\r\n");
        assert!(!parse(&raw, Method::GET).0.plain, "{hop}");
    }
}

#[test]
fn framing_and_keep_alive() {
    let (h, len, f, ka) = parse(
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        Method::GET,
    );
    assert_eq!((h.status, len, ka), (StatusCode::OK, 38, true));
    assert!(matches!(f, Framing::Length(5)));
    let (_, _, f, ka) = parse(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        Method::GET,
    );
    assert!(matches!(f, Framing::Chunked) && ka);
    let (_, _, f, ka) = parse("HTTP/1.0 200 OK\r\n\r\n", Method::GET);
    assert!(matches!(f, Framing::UntilClose) && !ka);
    let (_, _, f, ka) = parse(
        "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
        Method::GET,
    );
    assert!(matches!(f, Framing::Length(0)) && ka);
    let (_, _, f, _) = parse("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", Method::HEAD);
    assert!(matches!(f, Framing::Empty));
    let (_, _, _, ka) = parse(
        "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        Method::GET,
    );
    assert!(!ka);
    // `close` ends the connection whatever follows it, in one header or two.
    for raw in [
        "HTTP/1.1 200 OK\r\nConnection: close, keep-alive\r\nContent-Length: 0\r\n\r\n",
        "HTTP/1.1 200 OK\r\nConnection: close\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
        "HTTP/1.0 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 0\r\n\r\n",
    ] {
        assert!(!parse(raw, Method::GET).3, "{raw:?}");
    }
    // A transfer coding in HTTP/1.0 is faulty framing: chunks are read, then the connection
    // ends (RFC 9112 §6.1).
    let (_, _, f, ka) = parse(
        "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n",
        Method::GET,
    );
    assert!(matches!(f, Framing::Chunked) && !ka);
    assert!(parse_head(
        &BytesMut::from("HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"),
        &Method::GET
    )
    .is_err());
    assert!(parse_head(&BytesMut::from("garbage\r\n\r\n"), &Method::GET).is_err());
    for bad in ["+5", "5 5", "5,5", "-1", "", "0x5", "99999999999999999999"] {
        let raw = format!("HTTP/1.1 200 OK\r\nContent-Length: {bad}\r\n\r\n");
        assert!(
            parse_head(&BytesMut::from(raw.as_str()), &Method::GET).is_err(),
            "{bad:?}"
        );
    }
    let (h, _, f, ka) = parse(
        "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        Method::GET,
    );
    assert!(
        matches!(f, Framing::Chunked) && !ka,
        "both framings: chunked, then close"
    );
    assert!(
        h.headers.contains_key("content-length"),
        "dropped on the way out"
    );
    assert!(
        parse_head(&BytesMut::from("HTTP/1.1 200 OK\r\nContent-"), &Method::GET)
            .expect("ok")
            .is_none()
    );
}

#[test]
fn chunk_sizes_are_strict() {
    assert_eq!(parse_chunk_size(b"1a"), Some(26));
    assert_eq!(parse_chunk_size(b"1a;ext=1"), Some(26));
    assert_eq!(parse_chunk_size(b"1a ;ext"), Some(26));
    assert_eq!(parse_chunk_size(b"1a \t;ext"), Some(26));
    for bad in [
        &b"+1a"[..],
        b" 1a",
        b"1a x",
        b"",
        b"0x1a",
        b"11111111111111111",
        b"1a\n;ext",
        b"1a\x0c;ext",
        b"1a\r;ext",
    ] {
        assert_eq!(
            parse_chunk_size(bad),
            None,
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn encodes_heads() {
    let mut h = Fields::default();
    h.insert(
        HeaderName::from_static("host"),
        HeaderValue::from_static("b:1"),
    );
    let mut out = Vec::new();
    encode_head(&Method::GET, "/a?b=1", &h, &Added::default(), &mut out);
    assert_eq!(out, b"GET /a?b=1 HTTP/1.1\r\nhost: b:1\r\n\r\n");
    // What the hop adds replaces the client's: its own `Host`, an `X-Forwarded-For`.
    h.insert(
        HeaderName::from_static("x-forwarded-for"),
        HeaderValue::from_static("10.0.0.9"),
    );
    h.insert(
        HeaderName::from_static("accept"),
        HeaderValue::from_static("*/*"),
    );
    let target = HeaderValue::from_static("t:2");
    let set = [(
        HeaderName::from_static("x-forwarded-for"),
        HeaderValue::from_static("10.0.0.9, 10.0.0.1"),
    )];
    let tp = [b'0'; 55];
    let added = Added {
        host: Some(&target),
        set: &set,
        traceparent: Some(&tp),
    };
    encode_head(&Method::GET, "/", &h, &added, &mut out);
    let text = String::from_utf8(out).expect("ascii");
    assert_eq!(
        text,
        format!(
            "GET / HTTP/1.1\r\nhost: t:2\r\naccept: */*\r\nx-forwarded-for: 10.0.0.9, 10.0.0.1\r\ntraceparent: {}\r\n\r\n",
            "0".repeat(55)
        )
    );
}
