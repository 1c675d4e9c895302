//! HTTP/2 flow control (RFC 9113 §6.9), for one stream or the connection: the window the
//! client sends into, with the credit owed back for what has been read, and the window
//! answers are sent into. No I/O: the connection writes the WINDOW_UPDATE these return.

/// The largest window RFC 9113 §6.9.1 allows.
pub(super) const MAX_WINDOW: i64 = (1 << 31) - 1;

/// What the client may still send, and the credit owed back to it: read (or dropped
/// unread) and not yet credited. The credit goes out as one WINDOW_UPDATE once half the
/// window is owed, so that a client is neither starved nor sent an update per frame.
#[derive(Debug)]
pub(super) struct RecvWindow {
    window: i64,
    owed: usize,
    half: usize,
}

impl RecvWindow {
    /// A window of `size`, credited back by halves of `full` (the size it is kept at).
    pub(super) fn new(size: i64, full: u32) -> Self {
        RecvWindow {
            window: size,
            owed: 0,
            half: full as usize / 2,
        }
    }

    /// Takes `n` bytes the client sent; false when they are past its window (a
    /// flow-control error), and then nothing is taken.
    pub(super) fn take(&mut self, n: usize) -> bool {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        if n > self.window {
            return false;
        }
        self.window -= n;
        true
    }

    /// Owes the client `n` more bytes of window.
    /// What the peer may still send before more window is given.
    pub(super) fn left(&self) -> i64 {
        self.window
    }

    pub(super) fn owe(&mut self, n: usize) {
        self.owed += n;
    }

    /// Whether any credit is owed.
    pub(super) fn owes(&self) -> bool {
        self.owed > 0
    }

    /// The WINDOW_UPDATE increment due, once half the window is owed; the window grows by
    /// it.
    pub(super) fn due(&mut self) -> Option<u32> {
        if self.owed < self.half {
            return None;
        }
        let inc = std::mem::take(&mut self.owed);
        self.window += i64::try_from(inc).unwrap_or(i64::MAX);
        Some(u32::try_from(inc).unwrap_or(u32::MAX))
    }
}

/// What the client lets the server send.
#[derive(Debug, Clone, Copy)]
pub(super) struct SendWindow(i64);

impl SendWindow {
    /// A window of `size` (65,535 until the client's SETTINGS say otherwise).
    pub(super) fn new(size: i64) -> Self {
        SendWindow(size)
    }

    /// Bytes that may be sent now (none when the window is spent or below zero).
    pub(super) fn room(&self) -> i64 {
        self.0
    }

    /// `n` bytes were sent.
    pub(super) fn spend(&mut self, n: usize) {
        self.0 -= i64::try_from(n).unwrap_or(i64::MAX);
    }

    /// A WINDOW_UPDATE of `inc`; false when the window passes the largest allowed (a
    /// flow-control error).
    pub(super) fn grow(&mut self, inc: i64) -> bool {
        self.0 += inc;
        self.0 <= MAX_WINDOW
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_may_not_send_past_its_window() {
        let mut w = RecvWindow::new(100, 100);
        assert!(w.take(60));
        assert!(!w.take(41), "past the window");
        assert!(w.take(40), "nothing was taken by the refused frame");
        assert!(!w.take(1));
    }

    #[test]
    fn credit_goes_back_by_halves_and_reopens_the_window() {
        let mut w = RecvWindow::new(100, 100);
        assert!(w.take(100));
        w.owe(30);
        assert!(w.owes());
        assert_eq!(w.due(), None, "less than half the window is owed");
        w.owe(20);
        assert_eq!(w.due(), Some(50));
        assert!(!w.owes());
        assert_eq!(w.due(), None);
        assert!(w.take(50));
        assert!(!w.take(1));
    }

    #[test]
    fn the_send_window_grows_up_to_the_largest_allowed() {
        let mut w = SendWindow::new(65_535);
        w.spend(65_535);
        assert_eq!(w.room(), 0);
        assert!(w.grow(MAX_WINDOW));
        assert_eq!(w.room(), MAX_WINDOW);
        assert!(!w.grow(1), "past 2^31 - 1");
        // A SETTINGS change may take a window below zero: nothing may be sent then.
        let mut w = SendWindow::new(10);
        assert!(w.grow(-20));
        assert!(w.room() < 0);
    }
}
