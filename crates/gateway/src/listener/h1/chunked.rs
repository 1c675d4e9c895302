//! The request body's framing, decoded from the connection's read buffer: a length, or
//! chunks (RFC 9112 §7.1) with their size lines, extensions and trailers. Strict: a size
//! line is hex digits, optional whitespace and `;` extensions, ended by CRLF; a chunk's data
//! is followed by CRLF exactly; anything else breaks the body off (400), since a lenient
//! reading here could differ from a proxy's in front.

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// The longest chunk-size line (with extensions) taken.
const MAX_SIZE_LINE: usize = 4096;
/// The most bytes of chunk extensions (and leading zeros past 16 digits) in one body, as
/// hyper's 16 KiB: extensions carry nothing the gateway uses, and many small chunks with
/// long extensions would otherwise cost far more than the body they carry.
const MAX_EXTENSIONS: usize = 16 * 1024;

/// What the next step of decoding gives.
#[derive(Debug, PartialEq)]
pub enum Decoded {
    /// A piece of the body.
    Data(Bytes),
    /// The trailers after the last chunk; the body has ended.
    Trailers(HeaderMap),
    /// The body has ended.
    End,
    /// More bytes must be read first.
    Need,
}

/// Why a body's framing is broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Broken(pub &'static str);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Length(u64),
    Size,
    Data(u64),
    DataEnd,
    Trailers,
    Done,
}

/// Decodes one request body from the connection's buffer.
#[derive(Debug, Clone)]
pub struct Decoder {
    state: State,
    /// How far a size line or the trailers have been searched for their end, so that bytes
    /// that come one at a time are not searched again and again.
    scanned: usize,
    /// Extension bytes so far.
    extensions: usize,
    /// The trailers' limits: the listener's head limits.
    max_trailer_bytes: usize,
    max_trailers: usize,
}

impl Decoder {
    /// A body of `n` bytes.
    pub fn length(n: u64) -> Decoder {
        Decoder {
            state: if n == 0 {
                State::Done
            } else {
                State::Length(n)
            },
            scanned: 0,
            extensions: 0,
            max_trailer_bytes: 0,
            max_trailers: 0,
        }
    }

    /// A chunked body whose trailers may take up to `max_bytes` in `max_fields` fields.
    pub fn chunked(max_bytes: usize, max_fields: usize) -> Decoder {
        Decoder {
            state: State::Size,
            scanned: 0,
            extensions: 0,
            max_trailer_bytes: max_bytes,
            max_trailers: max_fields,
        }
    }

    /// Bytes left, when known.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// Bytes announced and not yet taken: the rest of the length, or of the chunk under
    /// way. A chunk's size counts as soon as its line is read, so that a body that says it
    /// will be too large is refused then, not when its bytes come.
    pub fn announced(&self) -> u64 {
        match self.state {
            State::Length(n) | State::Data(n) => n,
            _ => 0,
        }
    }

    /// The next step, from the bytes in `buf` (what it uses is taken out of it).
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, Broken> {
        loop {
            match self.state {
                State::Done => return Ok(Decoded::End),
                State::Length(left) => {
                    let Some((data, left)) = take_up_to(buf, left) else {
                        return Ok(Decoded::Need);
                    };
                    self.state = if left == 0 {
                        State::Done
                    } else {
                        State::Length(left)
                    };
                    return Ok(Decoded::Data(data));
                }
                State::Size => {
                    let from = self.scanned.min(buf.len());
                    let upto = buf.len().min(MAX_SIZE_LINE);
                    let found = buf[from.min(upto)..upto].iter().position(|b| *b == b'\n');
                    let Some(k) = found else {
                        if buf.len() >= MAX_SIZE_LINE {
                            return Err(Broken("chunk size line too long"));
                        }
                        self.scanned = buf.len();
                        return Ok(Decoded::Need);
                    };
                    let nl = from.min(upto) + k;
                    self.scanned = 0;
                    let line = buf.split_to(nl + 1);
                    let (size, extra) = chunk_size(&line[..nl])?;
                    self.extensions += extra;
                    if self.extensions > MAX_EXTENSIONS {
                        return Err(Broken("chunk extensions too large"));
                    }
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::Data(size)
                    };
                }
                State::Data(left) => {
                    let Some((data, left)) = take_up_to(buf, left) else {
                        return Ok(Decoded::Need);
                    };
                    self.state = if left == 0 {
                        State::DataEnd
                    } else {
                        State::Data(left)
                    };
                    return Ok(Decoded::Data(data));
                }
                State::DataEnd => {
                    if buf.len() < 2 {
                        if buf.first().is_some_and(|b| *b != b'\r') {
                            return Err(Broken("chunk data not followed by CRLF"));
                        }
                        return Ok(Decoded::Need);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(Broken("chunk data not followed by CRLF"));
                    }
                    let _ = buf.split_to(2);
                    self.state = State::Size;
                }
                State::Trailers => return self.trailers(buf),
            }
        }
    }

    /// After the last chunk: an empty line, or trailer fields then an empty line.
    fn trailers(&mut self, buf: &mut BytesMut) -> Result<Decoded, Broken> {
        if buf.len() < 2 {
            if buf
                .first()
                .is_some_and(|b| *b != b'\r' && !b.is_ascii_graphic())
            {
                return Err(Broken("malformed trailer section"));
            }
            return Ok(Decoded::Need);
        }
        if &buf[..2] == b"\r\n" {
            let _ = buf.split_to(2);
            self.state = State::Done;
            return Ok(Decoded::End);
        }
        let limit = self.max_trailer_bytes.max(64);
        // Searched from where the last search stopped (less 3: the end may straddle reads).
        let upto = buf.len().min(limit + 4);
        let from = self.scanned.saturating_sub(3).min(upto);
        let found = buf[from..upto].windows(4).position(|w| w == b"\r\n\r\n");
        let Some(end) = found.map(|k| from + k) else {
            if buf.len() >= limit {
                return Err(Broken("trailers larger than max_header_bytes"));
            }
            self.scanned = buf.len();
            return Ok(Decoded::Need);
        };
        self.scanned = 0;
        let block = buf.split_to(end + 4).freeze();
        // Every line ends in CRLF: a bare LF could end a line here and not behind.
        let bare_lf = block
            .iter()
            .enumerate()
            .any(|(i, b)| *b == b'\n' && (i == 0 || block[i - 1] != b'\r'));
        if bare_lf {
            return Err(Broken("malformed trailer section"));
        }
        let mut slots = vec![httparse::EMPTY_HEADER; self.max_trailers.max(1)];
        let fields = match httparse::parse_headers(&block, &mut slots) {
            Ok(httparse::Status::Complete((_, fields))) => fields,
            Ok(httparse::Status::Partial) | Err(_) => {
                return Err(Broken("malformed trailer section"))
            }
        };
        let mut map = HeaderMap::with_capacity(fields.len());
        for f in fields {
            let name = HeaderName::from_bytes(f.name.as_bytes())
                .map_err(|_| Broken("malformed trailer section"))?;
            let value = HeaderValue::from_bytes(f.value)
                .map_err(|_| Broken("malformed trailer section"))?;
            map.append(name, value);
        }
        self.state = State::Done;
        Ok(Decoded::Trailers(map))
    }
}

/// Up to `left` bytes from the front of `buf`, and what is left after them; `None` when
/// `buf` is empty.
fn take_up_to(buf: &mut BytesMut, left: u64) -> Option<(Bytes, u64)> {
    if buf.is_empty() {
        return None;
    }
    let take = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
    Some((buf.split_to(take).freeze(), left - take as u64))
}

/// A chunk-size line without its LF: hex digits, optional whitespace and `;` extensions,
/// then the CR. No control bytes but tab anywhere in it. Returns the size and the bytes
/// that carry nothing (extensions, leading digits past 16).
fn chunk_size(line: &[u8]) -> Result<(u64, usize), Broken> {
    let Some(line) = line.strip_suffix(b"\r") else {
        return Err(Broken("chunk size line not ended by CRLF"));
    };
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return Err(Broken("invalid chunk size"));
    }
    let rest = &line[digits..];
    if rest
        .iter()
        .any(|b| (b.is_ascii_control() && *b != b'\t') || *b == 0x7f)
    {
        return Err(Broken("control byte in a chunk size line"));
    }
    let rest = rest.trim_ascii_start();
    if !(rest.is_empty() || rest.first() == Some(&b';')) {
        return Err(Broken("invalid chunk size"));
    }
    let size = line[..digits].iter().try_fold(0u64, |n, b| {
        let d = char::from(*b).to_digit(16).map(u64::from);
        d.and_then(|d| n.checked_mul(16)?.checked_add(d))
            .ok_or(Broken("chunk size too large"))
    })?;
    Ok((size, line.len() - digits + digits.saturating_sub(16)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(d: &mut Decoder, input: &[u8]) -> Result<(Vec<u8>, Option<HeaderMap>), Broken> {
        let mut buf = BytesMut::from(input);
        let mut body = Vec::new();
        loop {
            match d.decode(&mut buf)? {
                Decoded::Data(b) => body.extend_from_slice(&b),
                Decoded::Trailers(t) => return Ok((body, Some(t))),
                Decoded::End => return Ok((body, None)),
                Decoded::Need => return Err(Broken("incomplete")),
            }
        }
    }

    #[test]
    fn chunks_with_extensions_and_trailers() {
        let mut d = Decoder::chunked(8192, 100);
        let (body, t) = all(
            &mut d,
            b"5;a=b\r\nhello\r\n1 ; x\r\n!\r\n0\r\nX-T: 1\r\n\r\n",
        )
        .unwrap();
        assert_eq!(body, b"hello!");
        assert_eq!(t.unwrap().get("x-t").unwrap(), "1");
        let mut d = Decoder::chunked(8192, 100);
        assert_eq!(all(&mut d, b"3\r\nabc\r\n0\r\n\r\n").unwrap().0, b"abc");
        // Leading zeros are digits like any other (RFC 9112 §7.1: 1*HEXDIG).
        let mut d = Decoder::chunked(8192, 100);
        let zeros = b"00000000000000000000003\r\nabc\r\n000000000000000000000\r\n\r\n";
        assert_eq!(all(&mut d, zeros).unwrap().0, b"abc");
    }

    #[test]
    fn broken_framing_is_refused() {
        for bad in [
            &b"5\nhello\r\n0\r\n\r\n"[..],
            b"5\r\nhelloXX0\r\n\r\n",
            b"g\r\n",
            b"-1\r\n",
            b"5\r\x00\r\n",
            b"11111111111111111\r\n",
            b"0000000000000000000000011111111111111111\r\n",
            b"0x5\r\nhello\r\n0\r\n\r\n",
            b"5 6\r\nhello\r\n",
            b"0\r\nbad header\r\n\r\n",
            b"0\r\nA: 1\nB: 2\r\n\r\n",
        ] {
            let mut d = Decoder::chunked(8192, 100);
            assert!(
                all(&mut d, bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn extensions_are_capped_per_body() {
        let mut input = Vec::new();
        for _ in 0..10 {
            input.extend_from_slice(b"1;");
            input.extend_from_slice(&[b'a'; 2000]);
            input.extend_from_slice(b"\r\nX\r\n");
        }
        input.extend_from_slice(b"0\r\n\r\n");
        let mut d = Decoder::chunked(8192, 100);
        assert_eq!(
            all(&mut d, &input).err(),
            Some(Broken("chunk extensions too large"))
        );
    }

    #[test]
    fn bytes_that_come_one_at_a_time_decode_the_same() {
        let input = b"5;a=b\r\nhello\r\n0\r\nX-T: 1\r\n\r\nNEXT";
        let mut d = Decoder::chunked(8192, 100);
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        let mut trailers = None;
        for b in input {
            buf.extend_from_slice(&[*b]);
            loop {
                match d.decode(&mut buf).unwrap() {
                    Decoded::Data(x) => body.extend_from_slice(&x),
                    Decoded::Trailers(t) => trailers = Some(t),
                    Decoded::Need | Decoded::End => break,
                }
            }
        }
        assert_eq!(body, b"hello");
        assert_eq!(trailers.unwrap().get("x-t").unwrap(), "1");
        assert_eq!(&buf[..], b"NEXT");
    }

    #[test]
    fn a_length_ends_where_it_says() {
        let mut d = Decoder::length(3);
        let mut buf = BytesMut::from(&b"abcGET"[..]);
        assert_eq!(
            d.decode(&mut buf),
            Ok(Decoded::Data(Bytes::from_static(b"abc")))
        );
        assert_eq!(d.decode(&mut buf), Ok(Decoded::End));
        assert_eq!(&buf[..], b"GET");
    }
}
