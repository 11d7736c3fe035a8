//! The target's side of a connection: queue pairs made for a peer's, with receive
//! buffers posted for its notifications.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use nixl::{NotificationSink, Result};
use tokio_util::task::TaskTracker;

use crate::api::{Completion, RecvWr, Sge, WcOpcode};
use crate::ffi::device::{Device, QueuePair, RegisteredBuf};

/// Receive work-request ids are `id << SLOT_BITS | slot`, with `id` unique in the
/// process: a stale completion of a destroyed queue pair whose number was reused
/// matches no buffer here.
const SLOT_BITS: u32 = 20;

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Where the completion loop delivers notifications: the agent's sink, and the
/// tracker that starts a task for those that must wait for room.
#[derive(Debug, Clone)]
pub(crate) struct Delivery {
    sink: NotificationSink,
    tasks: TaskTracker,
}

impl Delivery {
    pub(crate) fn new(sink: NotificationSink, tasks: TaskTracker) -> Self {
        Self { sink, tasks }
    }
}

/// Notifications that found the agent's queue full, in arrival order, each with its
/// buffer's slot, which is posted again only once the notification is delivered.
#[derive(Debug, Default)]
struct Held {
    queue: VecDeque<(usize, Bytes)>,
    /// A task is delivering `queue` (and will take what is added to it).
    draining: bool,
}

/// One queue pair a peer connected to, with its notification buffers.
pub(crate) struct Inbound {
    pub(crate) peer: String,
    pub(crate) qp_num: u32,
    id: u64,
    /// Declared before the buffers: dropped (destroyed) first, so the device never
    /// writes a buffer that is gone.
    qp: Mutex<Option<QueuePair>>,
    /// Leaked instead of freed when the queue pair could not be destroyed; `None`
    /// only while dropping.
    ring: Option<Ring>,
    leak: std::sync::atomic::AtomicBool,
    held: Mutex<Held>,
}

impl Drop for Inbound {
    fn drop(&mut self) {
        self.close();
        if self.leak.load(std::sync::atomic::Ordering::Acquire) {
            std::mem::forget(self.ring.take());
        }
    }
}

/// Receive buffers: `slots` of `size` bytes in one registration. The device writes
/// them, so they are reached through copies only, never a Rust reference.
struct Ring {
    buf: RegisteredBuf,
    size: usize,
}

impl Inbound {
    /// A queue pair in INIT with a buffer of `size` bytes posted for each of its
    /// receive-queue entries.
    pub(crate) fn new(peer: &str, dev: &Arc<Device>, qp: QueuePair, size: usize) -> Result<Self> {
        let slots = (qp.qp.caps.max_recv_wr.max(1) as usize).min(1 << SLOT_BITS);
        let size = size.max(1);
        // Freed after the queue pair (field order of `Inbound`).
        let buf = RegisteredBuf::new(dev, slots * size)?;
        let me = Self {
            peer: peer.to_owned(),
            qp_num: qp.qp.qp_num,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            qp: Mutex::new(Some(qp)),
            ring: Some(Ring { buf, size }),
            leak: std::sync::atomic::AtomicBool::new(false),
            held: Mutex::default(),
        };
        let wrs: Vec<RecvWr> = (0..slots).map(|i| me.recv_wr(i)).collect();
        me.post(&wrs)?;
        Ok(me)
    }

    fn ring(&self) -> &Ring {
        self.ring.as_ref().expect("taken only while dropping")
    }

    fn recv_wr(&self, slot: usize) -> RecvWr {
        let r = self.ring();
        RecvWr {
            wr_id: self.id << SLOT_BITS | slot as u64,
            sge: Sge {
                addr: r.buf.addr(slot * r.size),
                len: r.size as u32,
                lkey: r.buf.lkey(),
            },
        }
    }

    fn post(&self, wrs: &[RecvWr]) -> Result<()> {
        let g = self.qp.lock().unwrap();
        let Some(qp) = g.as_ref() else {
            return Ok(());
        };
        // The buffers are in the ring, registered, and outlive the queue pair.
        qp.post_recv(wrs).map_err(|p| p.error)
    }

    /// Run `f` on the queue pair, if it is still there.
    pub(crate) fn with_qp<T>(&self, f: impl FnOnce(&QueuePair) -> T) -> Option<T> {
        self.qp.lock().unwrap().as_ref().map(f)
    }

    /// A completion of this queue pair: a notification arrived (deliver it, post the
    /// buffer again), or a flush after closing.
    ///
    /// A notification that finds the agent's queue full ([`nixl::NotificationLimits`])
    /// is not dropped: it waits, with those after it on this queue pair, in a task
    /// that delivers them in order as the application reads, posting each buffer
    /// again only once its notification is delivered. Meanwhile the peer's sends find
    /// fewer buffers and then none, and its NIC retries them (receiver not ready,
    /// retried without limit): back-pressure on this peer's queue pair alone.
    pub(crate) fn on_completion(self: &Arc<Self>, c: &Completion, to: &Delivery) {
        let slot = (c.wr_id & ((1 << SLOT_BITS) - 1)) as usize;
        let r = self.ring();
        if c.wr_id >> SLOT_BITS != self.id
            || !c.status.is_ok()
            || c.opcode != WcOpcode::Recv
            || slot * r.size >= r.buf.len()
        {
            if c.status.is_ok() {
                tracing::debug!(peer = %self.peer, wr_id = c.wr_id, "verbs: unexpected completion on an inbound queue pair; ignored");
            }
            return;
        }
        let len = (c.byte_len as usize).min(r.size);
        let mut msg = vec![0u8; len];
        // Slot `slot` lies inside the ring (checked above) and the device finished
        // writing it before it reported the completion; it is not posted again until
        // the bytes are copied out.
        r.buf.read(slot * r.size, &mut msg);
        let mut msg = Bytes::from(msg);
        let mut held = self.held.lock().unwrap();
        if !held.draining {
            match to.sink.try_deliver(&self.peer, msg) {
                Ok(()) => {
                    drop(held);
                    return self.repost(slot);
                }
                Err(m) => msg = m,
            }
            held.draining = true;
            tracing::debug!(peer = %self.peer, "verbs: the agent's notification queue is full; holding this queue pair's notifications until the application reads");
            let (me, sink) = (self.clone(), to.sink.clone());
            to.tasks.spawn(async move { me.drain(sink).await });
        }
        held.queue.push_back((slot, msg));
    }

    /// Deliver the held notifications in order, waiting for room, each buffer posted
    /// again once its notification is in; ends when none is left, or when the agent
    /// stopped (nothing will read them then).
    async fn drain(self: Arc<Self>, sink: NotificationSink) {
        loop {
            let (slot, msg) = {
                let mut held = self.held.lock().unwrap();
                match held.queue.pop_front() {
                    Some(h) => h,
                    None => {
                        held.draining = false;
                        return;
                    }
                }
            };
            if sink.deliver_async(&self.peer, msg).await.is_err() {
                return;
            }
            self.repost(slot);
        }
    }

    fn repost(&self, slot: usize) {
        if let Err(e) = self.post(&[self.recv_wr(slot)]) {
            tracing::warn!(peer = %self.peer, error = %e, "verbs: reposting a notification buffer failed");
        }
    }

    /// Destroy the queue pair (the peer's next work request fails); the buffers go
    /// when this is dropped. Should the device refuse to destroy it, the buffers are
    /// leaked instead (the device may still write them).
    ///
    /// Returns only once the queue pair is destroyed, whoever closes it: the lock is
    /// held across the destroy, so a second caller (the connection's task and a
    /// shutdown race here) waits for the first. A shutdown deregisters memory right
    /// after this returns, and the peer must not reach it through a queue pair still
    /// being destroyed.
    pub(crate) fn close(&self) {
        let mut slot = self.qp.lock().unwrap();
        if let Some(mut qp) = slot.take() {
            if let Err(e) = qp.destroy() {
                tracing::error!(peer = %self.peer, error = %e, "verbs: a queue pair could not be destroyed; its receive buffers are leaked");
                self.leak.store(true, std::sync::atomic::Ordering::Release);
                std::mem::forget(qp);
            }
        }
    }
}

#[cfg(all(test, feature = "test-double"))]
mod tests {
    use super::*;
    use crate::ffi::device::QpUse;
    use crate::VerbsOptions;

    /// Two threads close the same inbound queue pair at once (a connection's task
    /// and a shutdown): when either `close` returns, the queue pair is destroyed,
    /// since a shutdown deregisters memory right after and a queue pair still being
    /// destroyed by the other caller would reach it.
    #[test]
    fn close_returns_only_once_the_queue_pair_is_destroyed() {
        let o = VerbsOptions::default();
        let dev = Arc::new(Device::open(crate::test_double::api(), &o).unwrap());
        for _ in 0..200 {
            let qp = QueuePair::create(&dev, dev.caps(&o), QpUse::Recv).unwrap();
            // INIT, as the backend leaves it before posting receives.
            let [init, _, _] = crate::plan::connect(
                &dev.endpoint,
                1,
                &dev.endpoint,
                qp.qp.qp_num,
                1,
                &o.reliability,
                1,
                1,
            );
            qp.modify(&[init]).unwrap();
            let inb = Arc::new(Inbound::new("peer", &dev, qp, 64).unwrap());
            // This device's objects (its own context, so other tests' do not count);
            // only the queue pair goes at `close`, the buffers stay with `inb`.
            let with_qp = crate::test_double::live_objects_of(dev.ctx);
            let start = Arc::new(std::sync::Barrier::new(2));
            let closers: Vec<_> = (0..2)
                .map(|_| {
                    let (inb, start, ctx) = (inb.clone(), start.clone(), dev.ctx);
                    std::thread::spawn(move || {
                        start.wait();
                        inb.close();
                        crate::test_double::live_objects_of(ctx)
                    })
                })
                .collect();
            for c in closers {
                assert_eq!(
                    c.join().unwrap(),
                    with_qp - 1,
                    "a close returned before the queue pair was destroyed"
                );
            }
        }
        assert_eq!(
            crate::test_double::violations_of(dev.ctx),
            Vec::<String>::new()
        );
    }
}
