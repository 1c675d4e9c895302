//! A body held in pieces, with small pieces gathered into larger ones: a body that arrives
//! a few bytes at a time (tiny chunks, a trickling peer) is held as its bytes, not as a
//! piece per few bytes, each keeping alive the whole read buffer it was cut from.

use bytes::Bytes;

/// Pieces shorter than this are copied into the piece being gathered.
pub(super) const SMALL_PIECE: usize = 4096;

/// The piece being gathered is set aside at this size.
pub(super) const GATHERED: usize = 16 * 1024;

/// Pieces of a body, in order.
#[derive(Default)]
pub(super) struct Gather {
    pieces: Vec<Bytes>,
    /// A small piece kept as it came while no other follows it: a small body in one piece
    /// (the usual JSON request) is not copied.
    lone: Option<Bytes>,
    small: Vec<u8>,
}

impl Gather {
    /// Takes the next piece.
    pub(super) fn push(&mut self, b: Bytes) {
        if b.len() >= SMALL_PIECE {
            self.set_small_aside();
            self.pieces.push(b);
        } else if self.lone.is_none() && self.small.is_empty() {
            self.lone = Some(b);
        } else {
            if let Some(first) = self.lone.take() {
                self.small.reserve(GATHERED);
                self.small.extend_from_slice(&first);
            }
            self.small.extend_from_slice(&b);
            if self.small.len() >= GATHERED {
                self.set_small_aside();
            }
        }
    }

    /// Moves the small pieces gathered so far into one piece of their size.
    fn set_small_aside(&mut self) {
        if let Some(first) = self.lone.take() {
            self.pieces.push(first);
        } else if !self.small.is_empty() {
            self.pieces.push(Bytes::copy_from_slice(&self.small));
            self.small.clear();
        }
    }

    /// The pieces, in order.
    pub(super) fn into_pieces(mut self) -> Vec<Bytes> {
        self.set_small_aside();
        self.pieces
    }

    /// How many pieces are held apart from the one being gathered, and its length.
    #[cfg(test)]
    pub(super) fn shape(&self) -> (usize, usize) {
        let gathering = self.lone.as_ref().map_or(self.small.len(), Bytes::len);
        (self.pieces.len(), gathering)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_sent_a_byte_at_a_time_is_held_as_its_bytes() {
        let buf = Bytes::from(vec![b'a'; 16 * 1024]);
        let mut g = Gather::default();
        let mut want = Vec::new();
        for i in 0..40_000usize {
            let piece = buf.slice(i % 100..i % 100 + 1);
            want.extend_from_slice(&piece);
            g.push(piece);
        }
        // 40,000 pieces: two gathered pieces and the bytes still gathering.
        assert_eq!(g.shape(), (2, 40_000 - 2 * GATHERED));
        let large = Bytes::from(vec![b'b'; 10_000]);
        g.push(large.clone());
        want.extend_from_slice(&large);
        g.push(Bytes::from_static(b"end"));
        want.extend_from_slice(b"end");
        assert_eq!(
            g.shape(),
            (4, 3),
            "the gathered bytes go before a large piece"
        );
        let pieces = g.into_pieces();
        assert_eq!(pieces.len(), 5);
        assert!(pieces
            .iter()
            .filter(|p| p.len() != 10_000)
            .all(|p| !buf.as_ptr_range().contains(&p.as_ptr())));
        assert_eq!(pieces.concat(), want);
        // A small body in one piece is kept as it came.
        let mut g = Gather::default();
        let one = buf.slice(..1000);
        g.push(one.clone());
        assert_eq!(g.into_pieces()[0].as_ptr(), one.as_ptr());
    }
}
