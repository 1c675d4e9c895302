//! What the access log and a recorded span keep of a request head before it goes on.

use crate::exchange::{ConnInfo, Parts};
use crate::observe::trace::SpanHead;
use http::HeaderValue;
use smallvec::SmallVec;

/// What the access log (and a recorded span) needs of the request head, copied before the
/// head is consumed.
pub(super) struct Head {
    pub(super) uri: SmallVec<[u8; 96]>,
    pub(super) bytes_in: Option<u64>,
    pub(super) span: Option<Box<SpanHead>>,
    /// The client a trusted proxy forwarded for, when the peer is one.
    pub(super) client: Option<HeaderValue>,
}

impl Head {
    /// What `req` leaves for the access log (when `logged`) and its span (when `sampled`).
    pub(super) fn of(req: &Parts, conn: &ConnInfo, logged: bool, sampled: bool) -> Self {
        let span = sampled.then(|| {
            let h = &req.headers;
            Box::new(SpanHead {
                host: h
                    .get(http::header::HOST)
                    .map(HeaderValue::as_bytes)
                    .or_else(|| req.uri.authority().map(|a| a.as_str().as_bytes()))
                    .map(SpanHead::copy),
                user_agent: h
                    .get(http::header::USER_AGENT)
                    .map(|v| SpanHead::copy(v.as_bytes())),
                version: req.version,
                https: conn.listener.tls.is_some(),
                port: conn.listener.address.port(),
                route_path: None,
            })
        });
        // Only the access log says how large the request was (a span leaves the
        // conventions' opt-in sizes out).
        let bytes_in = logged
            .then(|| {
                req.headers
                    .get(http::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok())
                    .or_else(|| {
                        (!req.headers.contains_key(http::header::TRANSFER_ENCODING)).then_some(0)
                    })
            })
            .flatten();
        let uri = req.uri.path_and_query().map_or_else(
            || SmallVec::from_slice(req.uri.path().as_bytes()),
            |pq| SmallVec::from_slice(pq.as_str().as_bytes()),
        );
        let client = conn.trusted.then(|| forwarded_client(req, conn)).flatten();
        Head {
            uri,
            bytes_in,
            span,
            client,
        }
    }
}

/// The client behind a trusted proxy, as nginx's `real_ip_recursive` finds it: the nearest
/// `X-Forwarded-For` address that is not a trusted proxy itself (the farthest one given
/// when all are). `None` (the peer is logged) without the header or past an entry that is
/// no address.
fn forwarded_client(req: &Parts, conn: &ConnInfo) -> Option<HeaderValue> {
    let trusted = &conn.listener.trusted_proxies;
    let mut farthest = None;
    let lines: SmallVec<[&HeaderValue; 2]> =
        req.headers.get_all("x-forwarded-for").iter().collect();
    for v in lines.into_iter().rev() {
        for entry in v.to_str().ok()?.rsplit(',') {
            let ip = address(entry.trim())?;
            farthest = Some(ip);
            if !trusted.iter().any(|n| n.contains(ip)) {
                return HeaderValue::from_str(&ip.to_string()).ok();
            }
        }
    }
    farthest.and_then(|ip| HeaderValue::from_str(&ip.to_string()).ok())
}

/// An `X-Forwarded-For` entry's address: `1.2.3.4`, `::1`, or with a port
/// (`1.2.3.4:5678`, `[::1]:80`).
fn address(entry: &str) -> Option<std::net::IpAddr> {
    entry
        .parse::<std::net::IpAddr>()
        .ok()
        .or_else(|| entry.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
        // `::ffff:10.0.0.1` is 10.0.0.1, for the trusted networks as for the log.
        .map(|ip| ip.to_canonical())
}
