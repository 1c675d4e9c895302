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
        "HTTP/1.1 200 OK\r\nTransfer-Encoding:  Chunked \r\n\r\n",
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
fn a_coding_other_than_chunked_alone_is_refused_in_any_field_order() {
    for te in [
        "Transfer-Encoding: gzip",
        "Transfer-Encoding: gzip, chunked",
        "Transfer-Encoding: identity",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
        "Transfer-Encoding: gzip\r\nContent-Length: 5",
        "Content-Length: 5\r\nTransfer-Encoding: gzip",
        "Transfer-Encoding: chunked,",
        "Transfer-Encoding: , chunked",
        "Transfer-Encoding: chunked;x",
        "Transfer-Encoding: ",
    ] {
        let raw = format!("HTTP/1.1 200 OK\r\n{te}\r\n\r\nhello world");
        assert!(
            matches!(
                parse_head(&BytesMut::from(raw.as_str()), &Method::GET),
                Err(H1Error::Coded)
            ),
            "{te:?}"
        );
        // No body is read for these: nothing to decode, so nothing to refuse.
        let raw = format!("HTTP/1.1 200 OK\r\n{te}\r\n\r\n");
        assert!(
            matches!(parse(&raw, Method::HEAD).2, Framing::Empty),
            "{te:?}"
        );
        let raw = format!("HTTP/1.1 304 Not Modified\r\n{te}\r\n\r\n");
        assert!(
            matches!(parse(&raw, Method::GET).2, Framing::Empty),
            "{te:?}"
        );
    }
    // Chunked beside a length, in either order: framed by chunks, then closed.
    for both in [
        "Transfer-Encoding: chunked\r\nContent-Length: 5",
        "Content-Length: 5\r\nTransfer-Encoding: chunked",
    ] {
        let raw = format!("HTTP/1.1 200 OK\r\n{both}\r\n\r\n");
        let (_, _, f, ka) = parse(&raw, Method::GET);
        assert!(matches!(f, Framing::Chunked) && !ka, "{both:?}");
    }
}

#[test]
fn chunk_sizes_are_strict() {
    assert_eq!(parse_chunk_size(b"1a"), Some(26));
    assert_eq!(parse_chunk_size(b"1a;ext=1"), Some(26));
    assert_eq!(parse_chunk_size(b"1a ;ext"), Some(26));
    assert_eq!(parse_chunk_size(b"1a \t;ext"), Some(26));
    assert_eq!(
        parse_chunk_size(b"1a "),
        Some(26),
        "spaces after, as clients may"
    );
    assert_eq!(parse_chunk_size(b"1a;a=\"b c\""), Some(26));
    for bad in [
        &b"1a;a=b\nc"[..],
        b"1a;a\rb",
        b"1a;a\x00b",
        b"1a;a\x7fb",
        b"+1a",
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
fn trailer_lines_need_only_be_field_text() {
    for ok in [
        &b"X-Checksum: abc"[..],
        b"X : odd but dropped",
        b" folded",
        b"X: a\tb",
    ] {
        assert!(field_text(ok), "{:?}", String::from_utf8_lossy(ok));
    }
    for bad in [&b"X: a\x00b"[..], b"X: a\rb", b"X: a\x7fb"] {
        assert!(!field_text(bad), "{:?}", String::from_utf8_lossy(bad));
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

/// An exchange kept busy until the task's budget is spent (an upstream flooding it with
/// interim answers) still sees its deadline: the timer is looked at outside the budget.
/// Without that, this poll would be Pending, and every poll of a flood alike.
#[tokio::test]
async fn a_deadline_passed_is_seen_when_the_exchange_spent_the_budget() {
    use super::super::h1_request::SendError;
    use std::future::{poll_fn, Future};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::task::coop;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let cap = super::super::cap::Cap::new(4);
    let pool = Pool::new(
        &addr,
        0,
        Duration::from_secs(60),
        Duration::from_secs(1),
        cap,
    );
    let permit = Arc::new(tokio::sync::Semaphore::new(1))
        .acquire_owned()
        .await
        .expect("a permit");
    let conn = pool.connect(permit).await.expect("connected");
    let (mut peer, _) = listener.accept().await.expect("accepted");
    let request = b"GET / HTTP/1.1\r\nhost: t\r\n\r\n";
    let wait = Duration::from_millis(50);
    let mut exchange =
        std::pin::pin!(conn.exchange_whole(request, request.len(), &Method::GET, wait));
    // Written, then waiting for a head: the timer is set.
    poll_fn(|cx| {
        assert!(exchange.as_mut().poll(cx).is_pending());
        Poll::Ready(())
    })
    .await;
    let mut got = [0u8; 27];
    peer.read_exact(&mut got).await.expect("the request");
    peer.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
        .await
        .expect("an interim answer");
    // The condition under test: the deadline has passed when the exchange is next polled
    // (its timer fires in the meantime).
    tokio::time::sleep(wait * 2).await;
    // A poll of its own, with the whole budget.
    tokio::task::yield_now().await;
    let polled = poll_fn(|cx| {
        // All but one unit spent: the exchange's read of the interim answer takes the
        // last, and its next read is refused by the budget.
        for _ in 0..127 {
            match coop::poll_proceed(cx) {
                Poll::Ready(unit) => unit.made_progress(),
                Poll::Pending => break,
            }
        }
        Poll::Ready(exchange.as_mut().poll(cx))
    })
    .await;
    assert!(
        matches!(polled, Poll::Ready(Err(SendError::TimedOut))),
        "{:?}",
        polled.map(|r| r.map(|(h, _)| h.status))
    );
}
