//! A [`BlockDevice`] over memory-mapped flash: the synchronous device.
//!
//! `submit` copies the extent from flash into the slot at once and queues its
//! completion, which the next `poll` returns; nothing is ever in flight between
//! calls, so `wait` and `cancel` have nothing to do (a cancelled read has already
//! completed, which the trait's contract allows).

use core::fmt;

use heapless::Deque;
use les_core::blockdev::{
    Alignment, BlockDevice, Completion, DeviceError, ReadRequest, ReadStatus, SlotId, SlotMemory,
    SubmitError, Tag,
};
use les_core::layout;
use les_core::schedule::{ExpertSource, Extent, Extents};
use les_core::slot_classes::{slot_span, SlotClass};
use les_core::slots::ExpertKey;

use crate::index::Index;

/// The only way a flash read fails: a request outside the flash or the slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfRange;

impl fmt::Display for OutOfRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("read outside the flash image or the slot")
    }
}

impl DeviceError for OutOfRange {
    fn is_transient(&self) -> bool {
        false
    }
}

/// Flash as a device, writing into `slots` (the slot classes' runs back to back);
/// `Q` completions can wait to be polled.
pub struct FlashDevice<'a, const Q: usize> {
    flash: &'a [u8],
    slots: &'a mut [u8],
    classes: &'a [SlotClass],
    done: Deque<Completion<OutOfRange>, Q>,
    /// Reads served.
    pub reads: u32,
    /// Bytes copied from flash into slots.
    pub bytes: u64,
}

impl<'a, const Q: usize> FlashDevice<'a, Q> {
    /// A device over `flash` filling `slots`.
    pub fn new(flash: &'a [u8], slots: &'a mut [u8], classes: &'a [SlotClass]) -> Self {
        FlashDevice {
            flash,
            slots,
            classes,
            done: Deque::new(),
            reads: 0,
            bytes: 0,
        }
    }
}

impl<const Q: usize> BlockDevice for FlashDevice<'_, Q> {
    type Error = OutOfRange;

    fn alignment(&self) -> Alignment {
        Alignment::NONE
    }

    fn queue_depth(&self) -> usize {
        Q
    }

    fn submit(&mut self, req: ReadRequest) -> Result<(), SubmitError<OutOfRange>> {
        if self.done.is_full() {
            return Err(SubmitError::Busy);
        }
        let len = req.len as usize;
        let src = usize::try_from(req.offset)
            .ok()
            .and_then(|o| self.flash.get(o..o.checked_add(len)?));
        let dst = self.span(req.slot).and_then(|(start, bytes)| {
            let end = (req.slot_offset as usize).checked_add(len)?;
            let at = start + req.slot_offset as usize;
            (end <= bytes).then(|| self.slots.get_mut(at..at + len))?
        });
        let (Some(src), Some(dst)) = (src, dst) else {
            return Err(SubmitError::Device(OutOfRange));
        };
        dst.copy_from_slice(src);
        self.reads += 1;
        self.bytes += len as u64;
        // Cannot fail: checked `is_full` above.
        let _ = self.done.push_back(Completion {
            tag: req.tag,
            status: ReadStatus::Done,
        });
        Ok(())
    }

    fn poll(&mut self) -> Option<Completion<OutOfRange>> {
        self.done.pop_front()
    }

    fn wait(&mut self) {}

    fn cancel(&mut self, _tag: Tag) {}
}

impl<const Q: usize> FlashDevice<'_, Q> {
    /// Where `slot` starts in the slot memory and its length.
    fn span(&self, slot: SlotId) -> Option<(usize, usize)> {
        slot_span(self.classes, slot.0 as usize)
    }
}

impl<const Q: usize> SlotMemory for FlashDevice<'_, Q> {
    fn slot(&self, slot: SlotId) -> &[u8] {
        self.span(slot)
            .and_then(|(start, bytes)| self.slots.get(start..start + bytes))
            .unwrap_or(&[])
    }
}

/// Where each expert is in flash (from the index), and its checksum.
pub struct FlashExperts<'i, 'a, const L: usize>(pub &'i Index<'a, L>);

impl<const L: usize> ExpertSource for FlashExperts<'_, '_, L> {
    fn extents(&self, key: ExpertKey) -> Extents {
        let mut ext = Extents::new();
        if let Ok(Some(x)) = self.0.expert(key.layer as usize, key.expert as usize) {
            let mut at = 0u32;
            for &(offset, len) in &x.parts[..x.n_parts] {
                // The index reader checked n_parts <= MAX_PARTS.
                let _ = ext.push(Extent {
                    offset: offset as u64,
                    len: len as u32,
                    slot_offset: at,
                });
                at += len as u32;
            }
        }
        ext
    }

    fn verify(&self, key: ExpertKey, slot: &[u8]) -> bool {
        match self.0.expert(key.layer as usize, key.expert as usize) {
            Ok(Some(x)) if x.crc_len == 0 => true,
            Ok(Some(x)) => slot
                .get(..x.crc_len)
                .is_some_and(|b| layout::checksum(b) == x.crc),
            _ => false,
        }
    }
}
