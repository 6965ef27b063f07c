//! [`FaultyDevice`]: a fault-injecting wrapper around a [`BlockDevice`] (the
//! [`FileDevice`](super::FileDevice) in tests), to check what the scheduler
//! promises about faults on a real device with real threads:
//!
//! - transient faults (delays, short reads, transient `EIO`) are retried and the
//!   output stays bit-identical;
//! - persistent faults (`EIO` that does not go away) and corrupted data (bit
//!   flips, caught by the packed checksums) end the run with an error naming the
//!   layer and expert, and nothing computed from the bad slot reaches the output.
//!
//! Which fault hits a read is decided at submit by a script, a function of the
//! request ([`Fault`]), so runs are reproducible; [`seeded`] makes one from a
//! seed and rates. Faults are applied on the way out:
//!
//! - [`Fault::Delay`] withholds the completion for that many polls (and waits);
//! - [`Fault::ShortRead`] and [`Fault::TransientEio`] turn a finished read into
//!   a transient error (the data may be partial);
//! - [`Fault::PermanentEio`] turns it into a permanent error;
//! - [`Fault::BitFlip`] reports success but flips one bit of what the slot holds
//!   (through an overlay: [`SlotMemory::slot`] shows the corrupted bytes until the
//!   slot is read into again).

use std::cell::OnceCell;
use std::collections::HashMap;
use std::io;

use les_core::blockdev::{
    Alignment, BlockDevice, Completion, ReadRequest, ReadStatus, SlotId, SlotMemory, SubmitError,
    Tag,
};

use super::FileError;

/// What happens to one read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Nothing.
    None,
    /// The completion is held back for this many polls.
    Delay(u32),
    /// Fewer bytes arrive than asked: a transient error.
    ShortRead,
    /// An I/O error that a retry fixes.
    TransientEio,
    /// An I/O error that stays.
    PermanentEio,
    /// The read succeeds, but bit `n % (8 * len)` of the data is flipped.
    BitFlip(u32),
}

/// How many reads met each fault.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Completions delayed.
    pub delays: u64,
    /// Short reads reported.
    pub short_reads: u64,
    /// Transient errors reported.
    pub transient: u64,
    /// Permanent errors reported.
    pub permanent: u64,
    /// Bits flipped.
    pub flips: u64,
}

/// Rates (per mille of reads) of each fault for [`seeded`].
#[derive(Clone, Copy, Debug, Default)]
pub struct FaultRates {
    /// Delays of 1 to 8 polls.
    pub delay: u32,
    /// Short reads.
    pub short_read: u32,
    /// Transient EIO.
    pub transient_eio: u32,
    /// Permanent EIO.
    pub permanent_eio: u32,
    /// Bit flips.
    pub bit_flip: u32,
    /// Transient faults (short reads, transient EIO) per device offset at most,
    /// so that a bounded number of retries always gets through (0 = no limit).
    pub max_transient_per_offset: u32,
}

/// A reproducible script: each read draws its fault from a seeded generator.
pub fn seeded(seed: u64, rates: FaultRates) -> impl FnMut(&ReadRequest) -> Fault {
    let mut state = seed ^ 0x5eed_fa17_0000_0001;
    let mut transient_at: HashMap<u64, u32> = HashMap::new();
    move |req| {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let roll = (z % 1000) as u32;
        let arg = (z >> 32) as u32;
        let mut at = 0;
        let mut hit = |rate: u32| {
            at += rate;
            roll < at
        };
        let fault = if hit(rates.permanent_eio) {
            Fault::PermanentEio
        } else if hit(rates.bit_flip) {
            Fault::BitFlip(arg)
        } else if hit(rates.short_read) {
            Fault::ShortRead
        } else if hit(rates.transient_eio) {
            Fault::TransientEio
        } else if hit(rates.delay) {
            Fault::Delay(1 + arg % 8)
        } else {
            Fault::None
        };
        if matches!(fault, Fault::ShortRead | Fault::TransientEio) {
            let n = transient_at.entry(req.offset).or_insert(0);
            if rates.max_transient_per_offset > 0 && *n >= rates.max_transient_per_offset {
                return Fault::None;
            }
            *n += 1;
        }
        fault
    }
}

struct Held {
    completion: Completion<FileError>,
    polls_left: u32,
}

/// A [`BlockDevice`] that injects the faults its script `F` chooses into the
/// reads of the device `D`.
pub struct FaultyDevice<D, F> {
    inner: D,
    script: F,
    pending: HashMap<Tag, (ReadRequest, Fault)>,
    held: Vec<Held>,
    flips: HashMap<u32, Flips>,
    counts: FaultCounts,
}

/// Bits flipped in a slot since those bytes were last read into, and the
/// corrupted copies of the slot, made when first looked at: the whole slot (when
/// no read into it is in flight) or its first bytes (when no read into those is).
#[derive(Default)]
struct Flips {
    bits: Vec<(usize, u8)>,
    copy: OnceCell<Vec<u8>>,
    prefix: OnceCell<Vec<u8>>,
}

impl Flips {
    /// `bytes` with the flips that fall inside them applied.
    fn apply(&self, bytes: &[u8]) -> Vec<u8> {
        let mut bytes = bytes.to_vec();
        for &(at, mask) in &self.bits {
            if let Some(b) = bytes.get_mut(at) {
                *b ^= mask;
            }
        }
        bytes
    }

    fn changed(&mut self) {
        self.copy = OnceCell::new();
        self.prefix = OnceCell::new();
    }
}

impl<D, F> FaultyDevice<D, F>
where
    D: BlockDevice<Error = FileError> + SlotMemory,
    F: FnMut(&ReadRequest) -> Fault,
{
    /// Wraps `inner`; `script` picks each read's fault at submit.
    pub fn new(inner: D, script: F) -> Self {
        FaultyDevice {
            inner,
            script,
            pending: HashMap::new(),
            held: Vec::new(),
            flips: HashMap::new(),
            counts: FaultCounts::default(),
        }
    }

    /// The faults injected so far.
    pub fn counts(&self) -> FaultCounts {
        self.counts
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    fn error(kind: io::ErrorKind, what: &str, req: &ReadRequest) -> FileError {
        FileError {
            kind,
            message: format!(
                "{what} reading {} bytes at offset {} (injected)",
                req.len, req.offset
            ),
        }
    }

    /// Applies the fault of a completion from the inner device; `None` when the
    /// completion is held back.
    fn inject(&mut self, c: Completion<FileError>) -> Option<Completion<FileError>> {
        let Some((req, fault)) = self.pending.get(&c.tag).copied() else {
            return Some(c); // not ours (cannot happen), pass it on
        };
        if let Fault::Delay(n) = fault {
            // Held once; the next time through it is delivered as it is.
            self.pending.insert(c.tag, (req, Fault::None));
            self.counts.delays += 1;
            self.held.push(Held {
                completion: c,
                polls_left: n,
            });
            return None;
        }
        self.pending.remove(&c.tag);
        if c.status != ReadStatus::Done {
            return Some(c); // cancelled or failed by the device itself
        }
        let status = match fault {
            Fault::None | Fault::Delay(_) => ReadStatus::Done,
            Fault::ShortRead => {
                self.counts.short_reads += 1;
                // Timed out mid-transfer: a partial read, worth retrying.
                ReadStatus::Failed(Self::error(io::ErrorKind::TimedOut, "short read", &req))
            }
            Fault::TransientEio => {
                self.counts.transient += 1;
                ReadStatus::Failed(Self::error(
                    io::ErrorKind::Interrupted,
                    "transient I/O error",
                    &req,
                ))
            }
            Fault::PermanentEio => {
                self.counts.permanent += 1;
                ReadStatus::Failed(Self::error(
                    io::ErrorKind::Other,
                    "Input/output error (os error 5)",
                    &req,
                ))
            }
            Fault::BitFlip(n) => {
                self.counts.flips += 1;
                let bit = n as usize % (req.len as usize * 8).max(1);
                let f = self.flips.entry(req.slot.0).or_default();
                f.bits
                    .push((req.slot_offset as usize + bit / 8, 1 << (bit % 8)));
                f.changed();
                ReadStatus::Done
            }
        };
        Some(Completion { tag: c.tag, status })
    }

    /// One poll's worth of time for held completions; returns a due one.
    fn tick(&mut self) -> Option<Completion<FileError>> {
        for h in &mut self.held {
            h.polls_left = h.polls_left.saturating_sub(1);
        }
        let i = self.held.iter().position(|h| h.polls_left == 0)?;
        let c = self.held.swap_remove(i).completion;
        self.inject(c)
    }
}

impl<D, F> BlockDevice for FaultyDevice<D, F>
where
    D: BlockDevice<Error = FileError> + SlotMemory,
    F: FnMut(&ReadRequest) -> Fault,
{
    type Error = FileError;

    fn alignment(&self) -> Alignment {
        self.inner.alignment()
    }

    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    fn submit(&mut self, req: ReadRequest) -> Result<(), SubmitError<FileError>> {
        // Held completions still occupy the queue, as far as the caller can tell.
        if self.pending.len() >= self.inner.queue_depth() {
            return Err(SubmitError::Busy);
        }
        self.inner.submit(req)?;
        let fault = (self.script)(&req);
        self.pending.insert(req.tag, (req, fault));
        // New data is coming into these bytes: their corruption is overwritten.
        if let Some(f) = self.flips.get_mut(&req.slot.0) {
            let range = req.slot_offset as usize..(req.slot_offset as usize + req.len as usize);
            f.bits.retain(|(at, _)| !range.contains(at));
            f.changed();
        }
        Ok(())
    }

    fn poll(&mut self) -> Option<Completion<FileError>> {
        if let Some(c) = self.tick() {
            return Some(c);
        }
        while let Some(c) = self.inner.poll() {
            if let Some(c) = self.inject(c) {
                return Some(c);
            }
        }
        None
    }

    fn wait(&mut self) {
        if !self.held.is_empty() {
            return; // the caller polls again, which advances the delays
        }
        self.inner.wait();
    }

    fn cancel(&mut self, tag: Tag) {
        self.inner.cancel(tag);
    }
}

impl<D, F> SlotMemory for FaultyDevice<D, F>
where
    D: SlotMemory,
{
    fn slot(&self, slot: SlotId) -> &[u8] {
        match self.flips.get(&slot.0) {
            Some(f) => f.copy.get_or_init(|| f.apply(self.inner.slot(slot))),
            None => self.inner.slot(slot),
        }
    }

    fn slot_prefix(&self, slot: SlotId, len: usize) -> &[u8] {
        match self.flips.get(&slot.0) {
            Some(f) => {
                let fresh = self.inner.slot_prefix(slot, len);
                let p = f.prefix.get_or_init(|| f.apply(fresh));
                assert!(
                    p.len() >= fresh.len(),
                    "slot {} asked for a longer prefix before its next read",
                    slot.0
                );
                &p[..fresh.len()]
            }
            None => self.inner.slot_prefix(slot, len),
        }
    }
}
