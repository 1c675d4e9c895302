//! The streams of one HTTP/2 connection: a table by id, each stream with its explicit
//! state (RFC 9113 §5.1, as a server sees it), the highest id the client opened, and the
//! ids of the last streams reset, whose late frames are ignored rather than errors.
//!
//! A stream is in the table from its HEADERS to its end; closed, it is gone from it. A
//! server's side ends when its answer has been sent. A client still sending then may go on
//! for [`LINGER`] (its frames checked as ever, its data dropped), the stream half closed
//! (local) until the client ends its side; past that, or past [`MAX_LINGERING`] such
//! streams, it is told to stop (RST_STREAM NO_ERROR, RFC 9113 §8.1) and its late frames
//! are ignored.

use super::super::body::Sender;
use super::super::frame;
use super::flow::{RecvWindow, SendWindow};
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use tokio::time::Instant;

/// Streams reset whose late frames are ignored rather than treated as errors.
const RECENT_RESETS: usize = 128;

/// How long a stream answered while its client still sends waits for the client's side
/// to end before the client is told to stop.
pub(super) const LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// Most streams of a connection that linger so; past them, an answered stream's client is
/// told to stop at once (a client that sends many bodies it never ends would otherwise
/// fill its stream limit with them).
pub(super) const MAX_LINGERING: usize = 8;

/// Where an open stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StreamState {
    /// The client may still send on it: its request body is coming.
    Open,
    /// The client has ended its side (END_STREAM): only the answer is to come.
    HalfClosedRemote,
    /// The answer has been sent and the client still sends: its frames are checked, its
    /// data dropped, until it ends its side or [`LINGER`] passes.
    HalfClosedLocal,
}

/// An answer being sent.
pub(super) struct Out<B> {
    pub(super) body: B,
    /// Data taken from the body and not yet sent (waiting for window).
    pub(super) pending: Option<Bytes>,
    /// The body ends after `pending`.
    pub(super) end_after: bool,
}

/// One stream in the table.
pub(super) struct Stream<B> {
    /// The slot of the stream's future while it runs.
    pub(super) slot: Option<usize>,
    /// Literal header bytes its request holds while its future runs and its body is still
    /// to come (counted in the connection's budget).
    pub(super) held: usize,
    /// Feeds the request body while the client sends it.
    pub(super) recv: Option<Sender>,
    /// Where the stream stands.
    pub(super) state: StreamState,
    /// What the client may still send on the stream, and the credit owed back to it.
    pub(super) window_in: RecvWindow,
    /// Declared `Content-Length` and DATA received.
    pub(super) length: Option<u64>,
    pub(super) received: u64,
    /// What the client lets the stream's answer send.
    pub(super) window_out: SendWindow,
    pub(super) out: Option<Out<B>>,
    /// A HEAD request: the answer has no body.
    pub(super) head: bool,
    /// The client waits for `100 Continue` before it sends the body (RFC 9110 §10.1.1).
    pub(super) expects_continue: bool,
    /// Since when the answer has waited on the client's window.
    pub(super) blocked_since: Option<Instant>,
    /// Bytes sent since then: a wait ends only with a frame's worth of progress.
    pub(super) sent_blocked: usize,
    /// The answer came from the upstream (it banks a reset once sent).
    pub(super) upstream: bool,
    /// When a stream half closed (local) is told to stop.
    pub(super) linger_until: Option<Instant>,
}

impl<B> Stream<B> {
    /// Owes the client `n` more bytes of window; sends the update once half the window
    /// is owed. Nothing is owed once the client has ended its side.
    /// A stream answered already gets none back either: what its client may still send is
    /// bounded by the window it has.
    pub(super) fn give_back(&mut self, wbuf: &mut Vec<u8>, id: u32, n: usize) {
        if self.state != StreamState::Open {
            return;
        }
        self.window_in.owe(n);
        if let Some(inc) = self.window_in.due() {
            frame::window_update(wbuf, id, inc);
        }
    }
}

type Map<V> = HashMap<u32, V, foldhash::fast::RandomState>;

/// The table of open streams, and what is remembered of the closed ones.
pub(super) struct Streams<V> {
    open: Map<V>,
    /// The last streams reset, oldest first.
    recent: VecDeque<u32>,
    /// The highest stream id the client has opened.
    last_id: u32,
}

impl<V> Default for Streams<V> {
    fn default() -> Self {
        Streams {
            open: Map::default(),
            recent: VecDeque::new(),
            last_id: 0,
        }
    }
}

impl<V> Streams<V> {
    /// Whether `id` names a stream the client has not opened: above the highest it opened,
    /// or even (a server's id).
    pub(super) fn idle(&self, id: u32) -> bool {
        id > self.last_id || id.is_multiple_of(2)
    }

    /// The highest stream id the client has opened (0 before any).
    pub(super) fn last_id(&self) -> u32 {
        self.last_id
    }

    /// Notes that the client opened `id` (ids only grow: `id` is idle).
    pub(super) fn opened(&mut self, id: u32) {
        self.last_id = id;
    }

    /// Remembers that `id` was reset, forgetting the oldest past [`RECENT_RESETS`].
    pub(super) fn remember(&mut self, id: u32) {
        if self.recent.len() == RECENT_RESETS {
            self.recent.pop_front();
        }
        self.recent.push_back(id);
    }

    /// Whether `id` was reset lately: its late frames are ignored.
    pub(super) fn was_reset(&self, id: u32) -> bool {
        self.recent.contains(&id)
    }

    pub(super) fn insert(&mut self, id: u32, v: V) {
        self.open.insert(id, v);
    }

    pub(super) fn get(&self, id: &u32) -> Option<&V> {
        self.open.get(id)
    }

    pub(super) fn get_mut(&mut self, id: &u32) -> Option<&mut V> {
        self.open.get_mut(id)
    }

    pub(super) fn remove(&mut self, id: &u32) -> Option<V> {
        self.open.remove(id)
    }

    pub(super) fn contains_key(&self, id: &u32) -> bool {
        self.open.contains_key(id)
    }

    /// Open streams.
    pub(super) fn len(&self) -> usize {
        self.open.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// The ids of the open streams.
    pub(super) fn ids(&self) -> Vec<u32> {
        self.open.keys().copied().collect()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&u32, &V)> {
        self.open.iter()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &V> {
        self.open.values()
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.open.values_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_above_the_last_opened_or_even_are_idle() {
        let mut t = Streams::<()>::default();
        assert!(t.idle(1));
        t.opened(5);
        assert!(!t.idle(1) && !t.idle(3) && !t.idle(5));
        assert!(t.idle(7));
        assert!(t.idle(2), "even ids are the server's");
        assert_eq!(t.last_id(), 5);
    }

    #[test]
    fn the_last_resets_are_remembered_and_the_oldest_forgotten() {
        let mut t = Streams::<()>::default();
        for id in (1..).step_by(2).take(RECENT_RESETS + 1) {
            t.remember(id);
        }
        assert!(!t.was_reset(1), "the oldest is forgotten");
        assert!(t.was_reset(3));
        assert!(t.was_reset(2 * RECENT_RESETS as u32 + 1));
    }

    #[test]
    fn a_stream_is_in_the_table_until_removed() {
        let mut t = Streams::default();
        t.opened(1);
        t.insert(1, StreamState::Open);
        t.insert(3, StreamState::HalfClosedRemote);
        assert_eq!(t.len(), 2);
        if let Some(s) = t.get_mut(&1) {
            *s = StreamState::HalfClosedRemote;
        }
        assert_eq!(t.get(&1), Some(&StreamState::HalfClosedRemote));
        assert_eq!(t.remove(&1), Some(StreamState::HalfClosedRemote));
        assert!(!t.contains_key(&1));
        assert_eq!(t.ids(), vec![3]);
    }
}
