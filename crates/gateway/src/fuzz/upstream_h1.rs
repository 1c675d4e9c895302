//! The lean HTTP/1.1 client's target: arbitrary answers from a loopback backend.

use super::runtime::{HANG, RUNTIME};
use crate::upstream::h1::Pool;
use crate::upstream::h1_response::H1Body;
use http::header::{self};
use http::Method;
use std::future::poll_fn;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

thread_local! {
    /// The loopback backend of `upstream_h1` and a pool that keeps nothing idle (made
    /// outside any runtime: no reaper task is left behind).
    static BACKEND: (std::net::TcpListener, Arc<Pool>) = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
        listener.set_nonblocking(true).expect("non-blocking");
        let addr = listener.local_addr().expect("its address");
        let cap = crate::upstream::cap::Cap::new(usize::MAX >> 4);
        let pool = Pool::new(
            &addr.to_string(),
            0,
            Duration::from_secs(60),
            Duration::from_secs(1),
            cap,
        );
        (listener, pool)
    };
}

/// `upstream_h1`: the lean HTTP/1.1 client's response parsing, head and body, over a
/// loopback connection. Input: a byte choosing the method (HEAD or GET) and the size of the
/// pieces the backend writes, then the bytes the backend answers before it closes.
pub fn upstream_h1(data: &[u8]) {
    let Some((&first, response)) = data.split_first() else {
        return;
    };
    let method = if first & 1 == 1 {
        Method::HEAD
    } else {
        Method::GET
    };
    let piece = [1, 7, 64, 512, 4096, usize::MAX][usize::from(first >> 1) % 6];
    let (listener, pool) = BACKEND.with(|(l, p)| (l.try_clone().expect("the listener"), p.clone()));
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let listener =
                tokio::net::TcpListener::from_std(listener).expect("the listener registered");
            let request = b"GET / HTTP/1.1\r\nhost: fuzz\r\n\r\n";
            let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
            let backend = async {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                // Read the request first: closing on unread bytes would reset the connection.
                let mut req = [0u8; 64];
                let _ = s.read_exact(&mut req[..request.len()]).await;
                for chunk in response.chunks(piece) {
                    if s.write_all(chunk).await.is_err() {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
                let _ = s.shutdown().await;
                let _ = done_rx.await;
            };
            let client = async {
                let permit = Arc::new(tokio::sync::Semaphore::new(1))
                    .acquire_owned()
                    .await
                    .expect("a permit");
                let conn = pool.connect(permit).await.expect("a loopback connection");
                exchange(conn, request, &method, response, &pool).await;
                let _ = done_tx.send(());
            };
            let both = async { tokio::join!(backend, client) };
            assert!(
                tokio::time::timeout(HANG, both).await.is_ok(),
                "the exchange did not end after the backend closed"
            );
        });
    });
}

/// One exchange and its body read to the end, with what must hold of them.
async fn exchange(
    conn: crate::upstream::h1::H1Conn,
    request: &[u8],
    method: &Method,
    response: &[u8],
    pool: &Arc<Pool>,
) {
    let Ok((head, body)) = conn
        .exchange_whole(request, request.len(), method, HANG)
        .await
    else {
        return;
    };
    assert!(!head.status.is_informational(), "a 1xx head came through");
    let has_body = *method == Method::GET && !matches!(head.status.as_u16(), 204 | 304);
    let mut codings = head.headers.get_all(header::TRANSFER_ENCODING).iter();
    if let (true, Some(first)) = (has_body, codings.next()) {
        assert!(
            first
                .as_bytes()
                .trim_ascii()
                .eq_ignore_ascii_case(b"chunked")
                && codings.next().is_none(),
            "a body read under a coding other than chunked alone: {first:?}"
        );
    }
    let mut body: H1Body = body.with_pool(pool.clone());
    let mut total = 0usize;
    let clean = loop {
        match poll_fn(|cx| body.poll_data(cx)).await {
            Some(Ok(piece)) => total += piece.len(),
            Some(Err(_)) => break false,
            None => break true,
        }
    };
    assert!(total <= response.len(), "more body than was sent");
    let framed_by_length = !head.headers.contains_key(header::TRANSFER_ENCODING) && has_body;
    if let (true, true, Some(len)) = (
        clean,
        framed_by_length,
        head.headers.get(header::CONTENT_LENGTH),
    ) {
        let len = len.to_str().ok().and_then(|l| l.parse::<usize>().ok());
        assert_eq!(
            len,
            Some(total),
            "a body that ended cleanly short of its length"
        );
    }
    if clean {
        assert!(body.is_done());
    }
}
