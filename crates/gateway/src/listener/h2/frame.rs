//! HTTP/2 frame types, flags, error codes and settings (RFC 9113 §6, §7), and the frames
//! the server writes.

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Frame types.
pub mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const PRIORITY: u8 = 0x2;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags.
pub mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

/// Error codes.
pub mod code {
    pub const NO_ERROR: u32 = 0x0;
    pub const PROTOCOL_ERROR: u32 = 0x1;
    pub const INTERNAL_ERROR: u32 = 0x2;
    pub const FLOW_CONTROL_ERROR: u32 = 0x3;
    pub const STREAM_CLOSED: u32 = 0x5;
    pub const FRAME_SIZE_ERROR: u32 = 0x6;
    pub const REFUSED_STREAM: u32 = 0x7;
    pub const CANCEL: u32 = 0x8;
    pub const COMPRESSION_ERROR: u32 = 0x9;
    pub const ENHANCE_YOUR_CALM: u32 = 0xb;
}

/// Settings identifiers.
pub const ENABLE_PUSH: u16 = 0x2;
pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
pub const MAX_FRAME_SIZE: u16 = 0x5;
pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;

/// A frame header.
pub fn head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = len as u32;
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// A SETTINGS frame.
pub fn settings(out: &mut Vec<u8>, values: &[(u16, u32)]) {
    head(out, 6 * values.len(), kind::SETTINGS, 0, 0);
    for (id, v) in values {
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&v.to_be_bytes());
    }
}

pub fn window_update(out: &mut Vec<u8>, stream: u32, inc: u32) {
    head(out, 4, kind::WINDOW_UPDATE, 0, stream);
    out.extend_from_slice(&inc.to_be_bytes());
}

pub fn rst_stream(out: &mut Vec<u8>, stream: u32, code: u32) {
    head(out, 4, kind::RST_STREAM, 0, stream);
    out.extend_from_slice(&code.to_be_bytes());
}

pub fn goaway(out: &mut Vec<u8>, last: u32, code: u32) {
    head(out, 8, kind::GOAWAY, 0, 0);
    out.extend_from_slice(&last.to_be_bytes());
    out.extend_from_slice(&code.to_be_bytes());
}

pub fn data(out: &mut Vec<u8>, stream: u32, data: &[u8], end: bool) {
    head(
        out,
        data.len(),
        kind::DATA,
        if end { flag::END_STREAM } else { 0 },
        stream,
    );
    out.extend_from_slice(data);
}

/// A header block: HEADERS, then CONTINUATION frames when it is larger than `max_frame`.
pub fn header_block(out: &mut Vec<u8>, stream: u32, block: &[u8], end: bool, max_frame: usize) {
    let mut pieces = block.chunks(max_frame.max(1)).peekable();
    let first = pieces.next().unwrap_or(&[]);
    let mut flags = if end { flag::END_STREAM } else { 0 };
    if pieces.peek().is_none() {
        flags |= flag::END_HEADERS;
    }
    head(out, first.len(), kind::HEADERS, flags, stream);
    out.extend_from_slice(first);
    while let Some(p) = pieces.next() {
        let last = pieces.peek().is_none();
        head(
            out,
            p.len(),
            kind::CONTINUATION,
            if last { flag::END_HEADERS } else { 0 },
            stream,
        );
        out.extend_from_slice(p);
    }
}
