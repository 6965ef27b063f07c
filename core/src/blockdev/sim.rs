//! [`SimDevice`]: a scripted device for tests and simulations.
//!
//! It serves reads from an in-memory image into caller-owned slot memory and
//! scripts everything a real device leaves to chance: latency and bandwidth in
//! simulated time, the order completions arrive in, whether cancellation is
//! honoured, and faults (transient or permanent errors, silent bit flips).
//!
//! Slot bytes are scribbled with garbage when a read is submitted and only get
//! the real data when its completion is delivered, so computing from a slot whose
//! read has not completed shows up as wrong results.

use heapless::Vec;

use super::{
    Alignment, BlockDevice, Completion, DeviceError, ReadRequest, ReadStatus, SlotId, SlotMemory,
    SubmitError, Tag,
};
use core::fmt;

/// Errors the simulated device reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimError {
    /// A scripted failure that a retry may fix.
    Transient,
    /// A scripted failure that persists.
    Permanent,
    /// The read lies outside the image or the slot.
    OutOfRange,
    /// The read violates the device alignment.
    Misaligned,
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SimError::Transient => "transient simulated I/O error",
            SimError::Permanent => "permanent simulated I/O error",
            SimError::OutOfRange => "read out of range",
            SimError::Misaligned => "misaligned read",
        })
    }
}

impl core::error::Error for SimError {}

impl DeviceError for SimError {
    fn is_transient(&self) -> bool {
        matches!(self, SimError::Transient)
    }
}

/// What a scripted fault does to one read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The read succeeds.
    None,
    /// The read fails with [`SimError::Transient`].
    Transient,
    /// The read fails with [`SimError::Permanent`].
    Permanent,
    /// The read "succeeds" but one bit of the data is flipped.
    BitFlip,
}

/// The order completions are delivered in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionOrder {
    /// By simulated finish time: one channel, urgent reads first among queued ones.
    Timed,
    /// Any read in flight may complete at any poll, chosen by a seeded generator;
    /// polls also return `None` at random while reads are in flight.
    Shuffled {
        /// Seed of the generator.
        seed: u64,
    },
}

/// Script of a [`SimDevice`].
#[derive(Clone, Copy, Debug)]
pub struct SimConfig {
    /// Fixed cost of every read, in simulated nanoseconds.
    pub latency_ns: u64,
    /// Transfer rate in bytes per simulated microsecond (1000 = 1 GB/s).
    pub bytes_per_us: u64,
    /// Alignment the device demands.
    pub alignment: Alignment,
    /// Completion order.
    pub order: CompletionOrder,
    /// Whether [`BlockDevice::cancel`] stops a read that has not completed.
    pub honor_cancel: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            latency_ns: 50_000,
            bytes_per_us: 2_000,
            alignment: Alignment::NONE,
            order: CompletionOrder::Timed,
            honor_cancel: true,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    req: ReadRequest,
    fault: Fault,
    cancelled: bool,
    /// Simulated time it finishes (Timed order); set when its transfer starts.
    finish_ns: Option<u64>,
}

/// Counters of what the device did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Requests accepted.
    pub submitted: u64,
    /// Bytes transferred by reads that completed (successfully or not).
    pub bytes: u64,
    /// Requests rejected as busy.
    pub busy: u64,
    /// Completions delivered as cancelled.
    pub cancelled: u64,
}

/// A scripted in-memory device with `Q` reads in flight at most.
///
/// `F` decides the [`Fault`] of each accepted request.
pub struct SimDevice<'a, F, const Q: usize> {
    image: &'a [u8],
    slots: &'a mut [u8],
    slot_size: usize,
    config: SimConfig,
    fault: F,
    in_flight: Vec<InFlight, Q>,
    rng: u64,
    now_ns: u64,
    channel_free_ns: u64,
    stats: SimStats,
}

impl<'a, F: FnMut(&ReadRequest) -> Fault, const Q: usize> SimDevice<'a, F, Q> {
    /// A device over `image`, writing into `slots` (consecutive slots of
    /// `slot_size` bytes).
    pub fn new(
        image: &'a [u8],
        slots: &'a mut [u8],
        slot_size: usize,
        config: SimConfig,
        fault: F,
    ) -> Self {
        let seed = match config.order {
            CompletionOrder::Shuffled { seed } => seed,
            CompletionOrder::Timed => 0,
        };
        SimDevice {
            image,
            slots,
            slot_size,
            config,
            fault,
            in_flight: Vec::new(),
            rng: seed ^ 0x9e37_79b9_7f4a_7c15,
            now_ns: 0,
            channel_free_ns: 0,
            stats: SimStats::default(),
        }
    }

    /// Simulated time now, in nanoseconds.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Advances simulated time, modelling compute done while reads proceed.
    pub fn advance(&mut self, ns: u64) {
        self.now_ns += ns;
    }

    /// What the device did so far.
    pub fn stats(&self) -> SimStats {
        self.stats
    }

    /// Reads in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn next_random(&mut self) -> u64 {
        // splitmix64: small, good enough for scripting orders.
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn transfer_ns(&self, len: u32) -> u64 {
        self.config.latency_ns + (len as u64 * 1000) / self.config.bytes_per_us.max(1)
    }

    fn slot_range(&self, req: &ReadRequest) -> Option<core::ops::Range<usize>> {
        let start = (req.slot.0 as usize)
            .checked_mul(self.slot_size)?
            .checked_add(req.slot_offset as usize)?;
        let end = start.checked_add(req.len as usize)?;
        let slot_end = (req.slot.0 as usize + 1).checked_mul(self.slot_size)?;
        (end <= slot_end && end <= self.slots.len()).then_some(start..end)
    }

    /// Starts the transfer of queued reads on the single channel (Timed order):
    /// urgent reads first, then in submission order.
    fn schedule_channel(&mut self) {
        if self.in_flight.iter().any(|r| r.finish_ns.is_some()) {
            return; // the channel is busy
        }
        let pick =
            self.in_flight
                .iter()
                .position(|r| r.req.urgent)
                .or(if self.in_flight.is_empty() {
                    None
                } else {
                    Some(0)
                });
        if let Some(i) = pick {
            let start = self.now_ns.max(self.channel_free_ns);
            let finish = start + self.transfer_ns(self.in_flight[i].req.len);
            self.in_flight[i].finish_ns = Some(finish);
            self.channel_free_ns = finish;
        }
    }

    fn deliver(&mut self, i: usize) -> Completion<SimError> {
        let r = self.in_flight.swap_remove(i);
        let status = if r.cancelled && self.config.honor_cancel {
            self.stats.cancelled += 1;
            ReadStatus::Cancelled
        } else {
            self.stats.bytes += r.req.len as u64;
            match r.fault {
                Fault::Transient => ReadStatus::Failed(SimError::Transient),
                Fault::Permanent => ReadStatus::Failed(SimError::Permanent),
                Fault::None | Fault::BitFlip => {
                    let src = r.req.offset as usize..r.req.offset as usize + r.req.len as usize;
                    let dst = self.slot_range(&r.req).expect("range checked at submit");
                    self.slots[dst.clone()].copy_from_slice(&self.image[src]);
                    if r.fault == Fault::BitFlip && !dst.is_empty() {
                        let at = dst.start + (self.next_random() as usize % dst.len());
                        self.slots[at] ^= 1 << (self.next_random() % 8);
                    }
                    ReadStatus::Done
                }
            }
        };
        Completion {
            tag: r.req.tag,
            status,
        }
    }
}

impl<F: FnMut(&ReadRequest) -> Fault, const Q: usize> BlockDevice for SimDevice<'_, F, Q> {
    type Error = SimError;

    fn alignment(&self) -> Alignment {
        self.config.alignment
    }

    fn queue_depth(&self) -> usize {
        Q
    }

    fn submit(&mut self, req: ReadRequest) -> Result<(), SubmitError<SimError>> {
        if !self.config.alignment.accepts(req.offset, req.len) {
            return Err(SubmitError::Device(SimError::Misaligned));
        }
        let in_image = (req.offset as usize)
            .checked_add(req.len as usize)
            .is_some_and(|end| req.offset <= usize::MAX as u64 && end <= self.image.len());
        let Some(dst) = self.slot_range(&req).filter(|_| in_image) else {
            return Err(SubmitError::Device(SimError::OutOfRange));
        };
        if self.in_flight.is_full() {
            self.stats.busy += 1;
            return Err(SubmitError::Busy);
        }
        let fault = (self.fault)(&req);
        // Scribble: until the completion is delivered the slot holds garbage.
        let noise = self.next_random() as u8 | 1;
        for b in &mut self.slots[dst] {
            *b ^= noise;
        }
        let entry = InFlight {
            req,
            fault,
            cancelled: false,
            finish_ns: None,
        };
        if self.in_flight.push(entry).is_err() {
            unreachable!("checked not full above");
        }
        self.stats.submitted += 1;
        if self.config.order == CompletionOrder::Timed {
            self.schedule_channel();
        }
        Ok(())
    }

    fn poll(&mut self) -> Option<Completion<SimError>> {
        if self.in_flight.is_empty() {
            return None;
        }
        match self.config.order {
            CompletionOrder::Timed => {
                let now = self.now_ns;
                let honor = self.config.honor_cancel;
                let i = self.in_flight.iter().position(|r| {
                    r.finish_ns.is_some_and(|f| f <= now)
                        || (honor && r.cancelled && r.finish_ns.is_none())
                })?;
                let c = self.deliver(i);
                self.schedule_channel();
                Some(c)
            }
            CompletionOrder::Shuffled { .. } => {
                let r = self.next_random();
                if r.is_multiple_of(4) {
                    return None; // not done yet
                }
                let i = (r >> 8) as usize % self.in_flight.len();
                Some(self.deliver(i))
            }
        }
    }

    fn wait(&mut self) {
        if let CompletionOrder::Timed = self.config.order {
            if let Some(f) = self.in_flight.iter().filter_map(|r| r.finish_ns).min() {
                self.now_ns = self.now_ns.max(f);
            }
        }
        // Shuffled: the next poll may still say "not yet"; callers poll again.
    }

    fn cancel(&mut self, tag: Tag) {
        if let Some(r) = self.in_flight.iter_mut().find(|r| r.req.tag == tag) {
            r.cancelled = true;
        }
    }
}

impl<F, const Q: usize> SlotMemory for SimDevice<'_, F, Q> {
    fn slot(&self, slot: SlotId) -> &[u8] {
        let start = slot.0 as usize * self.slot_size;
        &self.slots[start..start + self.slot_size]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(tag: u32, offset: u64, len: u32, slot: u32, urgent: bool) -> ReadRequest {
        ReadRequest {
            tag: Tag(tag),
            offset,
            len,
            slot: SlotId(slot),
            slot_offset: 0,
            urgent,
        }
    }

    #[test]
    fn timed_reads_complete_in_simulated_time_urgent_first() {
        let image: std::vec::Vec<u8> = (0..=255).collect();
        let mut slots = [0u8; 64];
        let cfg = SimConfig {
            latency_ns: 1000,
            bytes_per_us: 16,
            ..SimConfig::default()
        };
        let mut dev: SimDevice<_, 4> = SimDevice::new(&image, &mut slots, 16, cfg, |_| Fault::None);
        dev.submit(req(1, 0, 16, 0, false)).unwrap();
        dev.submit(req(2, 16, 16, 1, false)).unwrap();
        dev.submit(req(3, 32, 16, 2, true)).unwrap();
        assert_eq!(dev.poll(), None, "nothing finishes at t=0");
        dev.wait();
        assert_eq!(dev.now_ns(), 2000);
        assert_eq!(dev.poll().unwrap().tag, Tag(1)); // already on the channel
        dev.wait();
        assert_eq!(dev.poll().unwrap().tag, Tag(3)); // urgent overtakes tag 2
        dev.wait();
        assert_eq!(dev.poll().unwrap().tag, Tag(2));
        assert_eq!(dev.now_ns(), 6000);
        assert_eq!(dev.slot(SlotId(2)), &image[32..48]);
    }

    #[test]
    fn rejects_bad_requests_and_reports_busy() {
        let image = [7u8; 64];
        let mut slots = [0u8; 32];
        let cfg = SimConfig {
            alignment: Alignment { io: 8, memory: 1 },
            ..SimConfig::default()
        };
        let mut dev: SimDevice<_, 1> = SimDevice::new(&image, &mut slots, 16, cfg, |_| Fault::None);
        assert_eq!(
            dev.submit(req(1, 4, 8, 0, true)),
            Err(SubmitError::Device(SimError::Misaligned))
        );
        assert_eq!(
            dev.submit(req(1, 0, 24, 0, true)),
            Err(SubmitError::Device(SimError::OutOfRange))
        );
        assert_eq!(
            dev.submit(req(1, 64, 8, 0, true)),
            Err(SubmitError::Device(SimError::OutOfRange))
        );
        dev.submit(req(1, 0, 8, 0, true)).unwrap();
        assert_eq!(dev.submit(req(2, 8, 8, 1, true)), Err(SubmitError::Busy));
    }

    #[test]
    fn cancel_and_faults_are_reported() {
        let image = [1u8; 64];
        let mut slots = [0u8; 64];
        let cfg = SimConfig {
            order: CompletionOrder::Shuffled { seed: 3 },
            ..SimConfig::default()
        };
        let mut dev: SimDevice<_, 4> =
            SimDevice::new(&image, &mut slots, 16, cfg, |r| match r.tag.0 {
                2 => Fault::Transient,
                3 => Fault::BitFlip,
                _ => Fault::None,
            });
        for t in 1..=4 {
            dev.submit(req(t, 0, 16, t - 1, false)).unwrap();
        }
        dev.cancel(Tag(4));
        let mut seen = std::vec::Vec::new();
        while seen.len() < 4 {
            if let Some(c) = dev.poll() {
                seen.push(c);
            }
        }
        seen.sort_by_key(|c| c.tag);
        assert_eq!(seen[0].status, ReadStatus::Done);
        assert_eq!(seen[1].status, ReadStatus::Failed(SimError::Transient));
        assert_eq!(seen[2].status, ReadStatus::Done);
        assert_eq!(seen[3].status, ReadStatus::Cancelled);
        assert_eq!(dev.slot(SlotId(0)), &[1u8; 16]);
        let flipped = dev.slot(SlotId(2)).iter().filter(|b| **b != 1).count();
        assert_eq!(flipped, 1);
    }
}
