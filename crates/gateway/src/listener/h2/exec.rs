//! The streams of one HTTP/2 connection run in the connection's own task: a slab of their
//! futures, each with a waker of its own that queues it to be polled. A stream can be
//! dropped at any time (the client reset it), which `FuturesUnordered` cannot do. Slots
//! and their wakers are reused, so a stream costs one allocation: its future's box.

use parking_lot::Mutex;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

/// The slots woken since the last look, and the connection's task.
#[derive(Default)]
struct Queue {
    ready: Mutex<Vec<usize>>,
    task: Mutex<Option<Waker>>,
}

/// The waker of one slot.
struct SlotWake {
    index: usize,
    /// Set while the slot is in the queue, so that it is queued once.
    queued: AtomicBool,
    queue: Arc<Queue>,
}

impl Wake for SlotWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            self.queue.ready.lock().push(self.index);
            if let Some(w) = self.queue.task.lock().as_ref() {
                w.wake_by_ref();
            }
        }
    }
}

struct Slot<F> {
    fut: Option<Pin<Box<F>>>,
    wake: Arc<SlotWake>,
    waker: Waker,
}

/// The futures of a connection's streams.
pub struct Exec<F> {
    slots: Vec<Slot<F>>,
    free: Vec<usize>,
    queue: Arc<Queue>,
    /// Swapped with the queue's list, so that neither is allocated again.
    polling: Vec<usize>,
}

impl<F: Future> Exec<F> {
    pub fn new() -> Self {
        Exec {
            slots: Vec::new(),
            free: Vec::new(),
            queue: Arc::default(),
            polling: Vec::new(),
        }
    }

    /// Adds a future, to be polled at the next [`Exec::poll`]; returns its slot.
    pub fn spawn(&mut self, fut: F) -> usize {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                let wake = Arc::new(SlotWake {
                    index: self.slots.len(),
                    queued: AtomicBool::new(false),
                    queue: self.queue.clone(),
                });
                self.slots.push(Slot {
                    fut: None,
                    waker: Waker::from(wake.clone()),
                    wake,
                });
                self.slots.len() - 1
            }
        };
        self.slots[index].fut = Some(Box::pin(fut));
        self.slots[index].wake.wake_by_ref();
        index
    }

    /// Drops the future in `slot` (its stream was reset).
    pub fn cancel(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            if s.fut.take().is_some() {
                self.free.push(slot);
            }
        }
    }

    /// Polls every woken future; `done` gets each one that finished, with its slot.
    /// The connection's task is woken when any is woken later.
    pub fn poll(&mut self, cx: &mut Context<'_>, mut done: impl FnMut(usize, F::Output)) {
        {
            let mut task = self.queue.task.lock();
            if !task.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *task = Some(cx.waker().clone());
            }
        }
        // A future that wakes itself at each poll would keep this loop going: after a few
        // rounds the rest waits for the task's next poll.
        for _ in 0..4 {
            std::mem::swap(&mut *self.queue.ready.lock(), &mut self.polling);
            if self.polling.is_empty() {
                return;
            }
            for i in self.polling.drain(..) {
                let slot = &mut self.slots[i];
                slot.wake.queued.store(false, Ordering::Release);
                let Some(fut) = slot.fut.as_mut() else {
                    continue;
                };
                if let Poll::Ready(out) = fut.as_mut().poll(&mut Context::from_waker(&slot.waker)) {
                    slot.fut = None;
                    self.free.push(i);
                    done(i, out);
                }
            }
        }
        if !self.queue.ready.lock().is_empty() {
            cx.waker().wake_by_ref();
        }
    }
}
