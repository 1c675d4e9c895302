//! `uring-spike ENGINE LISTEN UPSTREAM`: ENGINE is `tokio` (epoll), `monoio-epoll`,
//! `monoio-uring` or `monoio-uring-defer` (DEFER_TASKRUN, single issuer). One thread; one
//! kept-alive upstream connection per client connection.

mod proto;

use proto::Action;
use std::net::SocketAddr;

const BUF: usize = 16 * 1024;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, engine, listen, upstream] = &args[..] else {
        eprintln!(
            "usage: uring-spike tokio|monoio-epoll|monoio-uring|monoio-uring-defer LISTEN UPSTREAM"
        );
        std::process::exit(2);
    };
    let listen: SocketAddr = listen.parse().expect("listen address");
    let upstream: SocketAddr = upstream.parse().expect("upstream address");
    match engine.as_str() {
        "tokio" => tokio_engine::run(listen, upstream),
        "monoio-epoll" => {
            let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
                .enable_timer()
                .build()
                .expect("monoio epoll runtime");
            rt.block_on(monoio_engine::serve(listen, upstream));
        }
        "monoio-uring" => {
            let mut rt = monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
                .with_entries(4096)
                .enable_timer()
                .build()
                .expect("monoio io_uring runtime");
            rt.block_on(monoio_engine::serve(listen, upstream));
        }
        "monoio-uring-defer" => {
            // Completions run only when the thread asks for them (no interrupting task
            // work), one thread submits: the kernel's cheapest way to run a ring.
            let mut urb = io_uring::IoUring::builder();
            urb.setup_coop_taskrun()
                .setup_single_issuer()
                .setup_defer_taskrun();
            let mut rt = monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
                .uring_builder(urb)
                .with_entries(4096)
                .enable_timer()
                .build()
                .expect("monoio io_uring runtime (defer taskrun)");
            rt.block_on(monoio_engine::serve(listen, upstream));
        }
        other => {
            eprintln!("unknown engine {other}");
            std::process::exit(2);
        }
    }
}

mod tokio_engine {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    pub fn run(listen: SocketAddr, upstream: SocketAddr) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("tokio runtime");
        rt.block_on(async move {
            let l = TcpListener::bind(listen).await.expect("bind");
            loop {
                let Ok((s, peer)) = l.accept().await else {
                    continue;
                };
                let _ = s.set_nodelay(true);
                tokio::spawn(conn(s, peer, upstream));
            }
        });
    }

    async fn conn(mut c: TcpStream, peer: SocketAddr, upstream: SocketAddr) {
        let peer = peer.ip().to_string();
        let mut up: Option<TcpStream> = None;
        let mut buf = vec![0u8; BUF];
        let mut filled = 0;
        let mut ubuf = vec![0u8; BUF];
        let mut out = Vec::with_capacity(BUF);
        loop {
            match c.read(&mut buf[filled..]).await {
                Ok(0) | Err(_) => return,
                Ok(n) => filled += n,
            }
            let mut start = 0;
            while let Some((len, action)) = proto::request(&buf[start..filled], &peer) {
                start += len;
                match action {
                    Action::Answer(bytes) => out.extend_from_slice(bytes),
                    Action::Forward(req) => {
                        if up.is_none() {
                            let Ok(s) = TcpStream::connect(upstream).await else {
                                return;
                            };
                            let _ = s.set_nodelay(true);
                            up = Some(s);
                        }
                        let Some(u) = up.as_mut() else { return };
                        if u.write_all(&req).await.is_err() {
                            return;
                        }
                        let mut got = 0;
                        let len = loop {
                            match u.read(&mut ubuf[got..]).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => got += n,
                            }
                            if let Some(len) = proto::response_len(&ubuf[..got]) {
                                break len;
                            }
                        };
                        out.extend_from_slice(&ubuf[..len]);
                    }
                }
            }
            buf.copy_within(start..filled, 0);
            filled -= start;
            if !out.is_empty() {
                if c.write_all(&out).await.is_err() {
                    return;
                }
                out.clear();
            }
        }
    }
}

mod monoio_engine {
    use super::*;
    use monoio::buf::IoBufMut;
    use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
    use monoio::net::{TcpListener, TcpStream};

    pub async fn serve(listen: SocketAddr, upstream: SocketAddr) {
        let l = TcpListener::bind(listen).expect("bind");
        loop {
            let Ok((s, peer)) = l.accept().await else {
                continue;
            };
            let _ = s.set_nodelay(true);
            monoio::spawn(conn(s, peer, upstream));
        }
    }

    async fn conn(mut c: TcpStream, peer: SocketAddr, upstream: SocketAddr) {
        let peer = peer.ip().to_string();
        let mut up: Option<TcpStream> = None;
        let mut buf: Vec<u8> = Vec::with_capacity(BUF);
        let mut ubuf: Vec<u8> = Vec::with_capacity(BUF);
        let mut out: Vec<u8> = Vec::with_capacity(BUF);
        loop {
            // Owned buffers: the kernel writes into `buf` past its length.
            let at = buf.len();
            let (res, b) = c.read(buf.slice_mut(at..)).await;
            buf = b.into_inner();
            match res {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let mut start = 0;
            while let Some((len, action)) = proto::request(&buf[start..], &peer) {
                start += len;
                match action {
                    Action::Answer(bytes) => out.extend_from_slice(bytes),
                    Action::Forward(req) => {
                        if up.is_none() {
                            let Ok(s) = TcpStream::connect(upstream).await else {
                                return;
                            };
                            let _ = s.set_nodelay(true);
                            up = Some(s);
                        }
                        let Some(u) = up.as_mut() else { return };
                        let (res, _) = u.write_all(req).await;
                        if res.is_err() {
                            return;
                        }
                        ubuf.clear();
                        let len = loop {
                            if ubuf.capacity() == ubuf.len() {
                                ubuf.reserve(BUF);
                            }
                            let at = ubuf.len();
                            let (res, b) = u.read(ubuf.slice_mut(at..)).await;
                            ubuf = b.into_inner();
                            match res {
                                Ok(0) | Err(_) => return,
                                Ok(_) => {}
                            }
                            if let Some(len) = proto::response_len(&ubuf) {
                                break len;
                            }
                        };
                        out.extend_from_slice(&ubuf[..len]);
                    }
                }
            }
            buf.drain(..start);
            if buf.capacity() == buf.len() {
                buf.reserve(BUF);
            }
            if !out.is_empty() {
                let (res, o) = c.write_all(out).await;
                out = o;
                if res.is_err() {
                    return;
                }
                out.clear();
            }
        }
    }
}
