//! The abstract read device experts stream from.
//!
//! Reads are asynchronous by nature on every real target (I/O threads, io_uring,
//! DMA), so the interface is submit / poll, with no allocation: the scheduler
//! [`submit`](BlockDevice::submit)s a [`ReadRequest`] naming the destination by
//! [`SlotId`], and later [`poll`](BlockDevice::poll)s a [`Completion`] carrying the
//! request's [`Tag`]. The memory behind a slot belongs to whoever implements
//! [`SlotMemory`] (usually the device itself); the scheduler never touches bytes.
//!
//! A synchronous device (memory-mapped flash on a microcontroller) simply copies in
//! `submit` and queues the completion for the next `poll`.
//!
//! Contract every device keeps, and the scheduler relies on:
//! - every accepted request produces exactly one completion, in any order;
//! - after [`cancel`](BlockDevice::cancel) the completion still arrives, with
//!   [`ReadStatus::Cancelled`] if the read was stopped, or the normal status if it
//!   had already finished; until then the slot's memory may still be written.

pub mod sim;

use core::fmt;

/// Identifies one submitted read; unique among reads in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(pub u32);

/// Index of an expert slot (a fixed region of RAM an expert is read into).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

/// A read of `len` bytes at device `offset` into slot `slot` at byte `slot_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    /// Echoed back in the completion.
    pub tag: Tag,
    /// Byte offset on the device.
    pub offset: u64,
    /// Bytes to read.
    pub len: u32,
    /// Destination slot.
    pub slot: SlotId,
    /// Destination offset inside the slot.
    pub slot_offset: u32,
    /// A demand read the computation waits for; devices serve these before
    /// speculative (prefetch) reads they have not started yet.
    pub urgent: bool,
}

/// How a read ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadStatus<E> {
    /// All bytes are in the slot.
    Done,
    /// The read was stopped after a [`BlockDevice::cancel`]; the slot holds garbage.
    Cancelled,
    /// The read failed; the slot holds garbage.
    Failed(E),
}

/// The end of one read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion<E> {
    /// The request's tag.
    pub tag: Tag,
    /// Its outcome.
    pub status: ReadStatus<E>,
}

/// Why a submit was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubmitError<E> {
    /// The device queue is full; poll for completions and retry.
    Busy,
    /// The request itself is invalid (misaligned, out of range) or the device failed.
    Device(E),
}

/// A device error that knows whether retrying can help.
pub trait DeviceError: fmt::Debug + fmt::Display + Clone {
    /// `true` for errors worth a bounded retry (timeouts, EINTR, short reads).
    fn is_transient(&self) -> bool;
}

/// The alignment a device requires, as data (O_DIRECT needs 512 B or 4 KiB).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alignment {
    /// Required alignment of device offsets and lengths, a power of two (1 = none).
    pub io: u32,
    /// Required alignment of destination addresses, a power of two.
    pub memory: u32,
}

impl Alignment {
    /// No requirement.
    pub const NONE: Alignment = Alignment { io: 1, memory: 1 };

    /// Whether `offset` and `len` satisfy the I/O alignment.
    pub fn accepts(&self, offset: u64, len: u32) -> bool {
        let m = self.io as u64 - 1;
        offset & m == 0 && len as u64 & m == 0
    }
}

/// An asynchronous, poll-based, allocation-free read device.
pub trait BlockDevice {
    /// The device's error type.
    type Error: DeviceError;

    /// Alignment the device requires of requests.
    fn alignment(&self) -> Alignment;

    /// Number of reads the device accepts at once.
    fn queue_depth(&self) -> usize;

    /// Starts a read. Returns [`SubmitError::Busy`] when the queue is full.
    fn submit(&mut self, req: ReadRequest) -> Result<(), SubmitError<Self::Error>>;

    /// Returns one finished read, if any, without blocking.
    fn poll(&mut self) -> Option<Completion<Self::Error>>;

    /// Blocks until a read has finished or none is in flight.
    fn wait(&mut self);

    /// Asks the device to stop the read `tag`, best effort (see the module contract).
    fn cancel(&mut self, tag: Tag);
}

/// Read access to the bytes of loaded slots.
pub trait SlotMemory {
    /// The bytes of slot `slot` (its full capacity).
    fn slot(&self, slot: SlotId) -> &[u8];

    /// The first `len` bytes of slot `slot` (at most its capacity), while reads
    /// into the rest of it may still be in flight: the scheduler asks for them
    /// only once the reads that wrote them completed. The default is
    /// [`slot`](Self::slot)'s start, for devices whose `slot` may be called with
    /// reads in flight; one that writes slots while the caller computes must
    /// check that no read in flight overlaps these bytes.
    fn slot_prefix(&self, slot: SlotId, len: usize) -> &[u8] {
        let s = self.slot(slot);
        &s[..len.min(s.len())]
    }
}

impl<D: BlockDevice + ?Sized> BlockDevice for &mut D {
    type Error = D::Error;

    fn alignment(&self) -> Alignment {
        (**self).alignment()
    }

    fn queue_depth(&self) -> usize {
        (**self).queue_depth()
    }

    fn submit(&mut self, req: ReadRequest) -> Result<(), SubmitError<Self::Error>> {
        (**self).submit(req)
    }

    fn poll(&mut self) -> Option<Completion<Self::Error>> {
        (**self).poll()
    }

    fn wait(&mut self) {
        (**self).wait()
    }

    fn cancel(&mut self, tag: Tag) {
        (**self).cancel(tag)
    }
}

impl<D: SlotMemory + ?Sized> SlotMemory for &mut D {
    fn slot(&self, slot: SlotId) -> &[u8] {
        (**self).slot(slot)
    }

    fn slot_prefix(&self, slot: SlotId, len: usize) -> &[u8] {
        (**self).slot_prefix(slot, len)
    }
}
