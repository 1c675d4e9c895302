//! Listener validation: address, limits on the request head and body, TLS, HTTP/2.

use super::problems::Problems;
use crate::file;
use crate::model::*;
use crate::tls::TlsConfig;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

pub(super) fn listeners(
    raw: &[file::Listener],
    base: &Path,
    p: &mut Problems,
) -> Vec<ListenerConfig> {
    if raw.is_empty() {
        p.add("listeners", "at least one listener is required");
    }
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, l) in raw.iter().enumerate() {
        let at = format!("listeners[{i}]");
        let Ok(address) = l.address.parse::<SocketAddr>() else {
            p.add(
                format!("{at}.address"),
                format!("{:?} is not an ip:port address", l.address),
            );
            continue;
        };
        if !seen.insert(address) {
            p.add(
                format!("{at}.address"),
                format!("{address} is listed twice"),
            );
        }
        let max_header_bytes = l.max_header_bytes.map_or(32 * 1024, |s| s.0);
        if !(1024..=1 << 20).contains(&max_header_bytes) {
            p.add(
                format!("{at}.max_header_bytes"),
                "must be between 1KiB and 1MiB",
            );
        }
        let max_headers = l.max_headers.unwrap_or(100);
        if !(1..=1000).contains(&max_headers) {
            p.add(format!("{at}.max_headers"), "must be between 1 and 1000");
        }
        let header_timeout = l.header_timeout.map_or(Duration::from_secs(30), |d| d.0);
        if header_timeout.is_zero() {
            p.add(format!("{at}.header_timeout"), "must be more than 0");
        }
        let body_timeout = l.body_timeout.map_or(Duration::from_secs(30), |d| d.0);
        if body_timeout.is_zero() {
            p.add(format!("{at}.body_timeout"), "must be more than 0");
        }
        let send_timeout = l.send_timeout.map_or(Duration::from_secs(60), |d| d.0);
        if send_timeout.is_zero() {
            p.add(format!("{at}.send_timeout"), "must be more than 0");
        }
        let max_connections = l.max_connections.unwrap_or(10_000);
        if max_connections == 0 {
            p.add(format!("{at}.max_connections"), "must be at least 1");
        }
        let mut trusted_proxies = Vec::new();
        for (j, t) in l.trusted_proxies.iter().enumerate() {
            match IpNet::parse(t) {
                Some(n) => trusted_proxies.push(n),
                None => p.add(
                    format!("{at}.trusted_proxies[{j}]"),
                    format!("{t:?} is not an address or address block (e.g. 10.0.0.0/8)"),
                ),
            }
        }
        let tls = l.tls.as_ref().and_then(|t| tls(t, &at, base, p));
        let http2 = http2(l.http2.as_ref(), max_header_bytes, &at, p);
        if l.h2c && l.tls.is_some() {
            p.add(
                format!("{at}.h2c"),
                "is for cleartext listeners; a TLS listener speaks HTTP/2 by ALPN",
            );
        }
        if l.http2.is_some() && l.tls.is_none() && !l.h2c {
            p.add(
                format!("{at}.http2"),
                "HTTP/2 needs `tls` (ALPN h2) or `h2c: true` on the listener",
            );
        }
        out.push(ListenerConfig {
            address,
            max_header_bytes: usize::try_from(max_header_bytes).unwrap_or(usize::MAX),
            max_headers,
            header_timeout,
            max_body_bytes: l.max_body_bytes.map_or(10 << 20, |s| s.0),
            body_timeout,
            send_timeout,
            max_connections,
            trusted_proxies,
            trust_request_id: l.trust_request_id,
            trust_trace_context: l.trust_trace_context,
            tls,
            h2c: l.h2c,
            http2,
        });
    }
    out
}

fn tls(t: &file::ListenerTls, at: &str, base: &Path, p: &mut Problems) -> Option<TlsConfig> {
    let at = format!("{at}.tls");
    if t.certificates.is_empty() {
        p.add(
            format!("{at}.certificates"),
            "at least one {cert, key} pair is required",
        );
    }
    let mut certificates = Vec::new();
    for (i, c) in t.certificates.iter().enumerate() {
        match crate::tls::load_cert(base.join(&c.cert), base.join(&c.key)) {
            Ok(cert) => certificates.push(cert),
            Err(e) => p.add(format!("{at}.certificates[{i}]"), e),
        }
    }
    let client_ca = t
        .client_ca
        .as_ref()
        .and_then(|f| match crate::tls::load_ca(base.join(f)) {
            Ok(ca) => Some(ca),
            Err(e) => {
                p.add(format!("{at}.client_ca"), e);
                None
            }
        });
    let client_auth_required = match t.client_auth.as_deref() {
        None | Some("required") => true,
        Some("optional") => false,
        Some(other) => {
            p.add(
                format!("{at}.client_auth"),
                format!("{other:?} is not `required` or `optional`"),
            );
            true
        }
    };
    if t.client_auth.is_some() && t.client_ca.is_none() {
        p.add(
            format!("{at}.client_auth"),
            "needs `client_ca` (the CA client certificates are verified against)",
        );
    }
    let version = t.min_version.as_ref().map(|v| {
        let v = v.0.trim();
        let lower = v.to_ascii_lowercase();
        match lower
            .strip_prefix("tlsv")
            .or_else(|| lower.strip_prefix("tls"))
        {
            Some(n) => n.trim().to_string(),
            None => v.to_string(),
        }
    });
    let tls12 = match version.as_deref() {
        None | Some("1.2") => true,
        Some("1.3") => false,
        Some(other) => {
            p.add(
                format!("{at}.min_version"),
                format!("{other:?} is not \"1.2\" or \"1.3\""),
            );
            true
        }
    };
    (certificates.len() == t.certificates.len()).then_some(TlsConfig {
        certificates,
        client_ca,
        client_auth_required,
        tls12,
    })
}

fn http2(
    h: Option<&file::Http2>,
    max_header_bytes: u64,
    at: &str,
    p: &mut Problems,
) -> Http2Config {
    let at = format!("{at}.http2");
    let size =
        |p: &mut Problems, field: &str, v: Option<crate::units::Size>, def: u64, min: u64| {
            // A default drawn from another field (the header list from
            // `max_header_bytes`) is that field's to report: it is only brought in range.
            let Some(v) = v.map(|s| s.0) else {
                return u32::try_from(def.clamp(min, (1 << 31) - 1)).unwrap_or(u32::MAX);
            };
            // HTTP/2 windows are at most 2^31-1 (RFC 9113 §6.9.1).
            if v < min || v > (1 << 31) - 1 {
                p.add(
                    format!("{at}.{field}"),
                    format!("must be between {min} bytes and 2GiB-1"),
                );
            }
            u32::try_from(v.min((1 << 31) - 1)).unwrap_or(u32::MAX)
        };
    let max_concurrent_streams = h.and_then(|h| h.max_concurrent_streams).unwrap_or(100);
    if max_concurrent_streams == 0 {
        p.add(format!("{at}.max_concurrent_streams"), "must be at least 1");
    }
    let max_pending_resets = h.and_then(|h| h.max_pending_resets).unwrap_or(20);
    if max_pending_resets == 0 {
        p.add(format!("{at}.max_pending_resets"), "must be at least 1");
    }
    let max_upstream_streams = h.and_then(|h| h.max_upstream_streams).unwrap_or(32);
    if max_upstream_streams == 0 {
        p.add(format!("{at}.max_upstream_streams"), "must be at least 1");
    }
    let max_request_buffer = h
        .and_then(|h| h.max_request_buffer)
        .map_or(1 << 20, |s| s.0);
    if max_request_buffer < 16 << 10 {
        p.add(format!("{at}.max_request_buffer"), "must be at least 16KiB");
    }
    Http2Config {
        max_concurrent_streams,
        max_header_list_size: size(
            p,
            "max_header_list_size",
            h.and_then(|h| h.max_header_list_size),
            max_header_bytes,
            1024,
        ),
        // 65,535 is the protocol's initial window: smaller ones would stall peers.
        stream_window: size(
            p,
            "stream_window",
            h.and_then(|h| h.stream_window),
            256 << 10,
            65_535,
        ),
        connection_window: size(
            p,
            "connection_window",
            h.and_then(|h| h.connection_window),
            1 << 20,
            65_535,
        ),
        max_pending_resets,
        max_upstream_streams,
        max_request_buffer,
    }
}
