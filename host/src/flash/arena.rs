//! Slot memory shared between the compute thread and the I/O threads.
//!
//! One page-aligned allocation of `n_slots * slot_bytes` bytes, written by I/O
//! threads (into slots whose reads are in flight) and read by the compute thread
//! (slots whose reads completed). Rust cannot see that these accesses never
//! overlap, so this module hands out raw ranges under a contract the file device
//! enforces with its own bookkeeping (see `FileDevice`): a range is written by
//! exactly one read in flight, and a slot is never read while any read into it is
//! in flight.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of every slot (O_DIRECT needs the logical block size; 4 KiB covers
/// every device seen in practice).
pub const SLOT_ALIGN: usize = 4096;

/// A fixed pool of equally sized, page-aligned slots.
pub struct SlotArena {
    ptr: NonNull<u8>,
    layout: Layout,
    slot_bytes: usize,
    n_slots: usize,
}

// SAFETY: the arena is a plain byte buffer; all shared access goes through
// `range_mut` / `slot`, whose callers guarantee the accesses are disjoint.
unsafe impl Send for SlotArena {}
// SAFETY: as above.
unsafe impl Sync for SlotArena {}

impl SlotArena {
    /// Allocates `n_slots` zeroed slots of at least `slot_bytes` bytes each (rounded
    /// up to [`SLOT_ALIGN`]). `None` if the size overflows or allocation fails.
    pub fn new(n_slots: usize, slot_bytes: usize) -> Option<SlotArena> {
        let slot_bytes = slot_bytes.max(1).checked_next_multiple_of(SLOT_ALIGN)?;
        let total = slot_bytes.checked_mul(n_slots.max(1))?;
        let layout = Layout::from_size_align(total, SLOT_ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })?;
        Some(SlotArena {
            ptr,
            layout,
            slot_bytes,
            n_slots,
        })
    }

    /// Bytes per slot (a multiple of [`SLOT_ALIGN`]).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Number of slots.
    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    fn checked(&self, slot: usize, offset: usize, len: usize) -> usize {
        assert!(
            slot < self.n_slots
                && offset
                    .checked_add(len)
                    .is_some_and(|e| e <= self.slot_bytes),
            "slot range out of bounds: slot {slot} offset {offset} len {len}"
        );
        slot * self.slot_bytes + offset
    }

    /// `len` bytes of slot `slot` from `offset`, for writing.
    ///
    /// # Safety
    /// No other reference to any byte of this range may exist while the returned
    /// slice lives: no concurrent `range_mut` overlapping it, no `slot` of this slot.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range_mut(&self, slot: usize, offset: usize, len: usize) -> &mut [u8] {
        let start = self.checked(slot, offset, len);
        // SAFETY: in bounds of the allocation (checked above); exclusivity is the
        // caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(start), len) }
    }

    /// The whole of slot `slot`, for reading.
    ///
    /// # Safety
    /// No `range_mut` of this slot may be alive while the returned slice lives.
    pub unsafe fn slot(&self, slot: usize) -> &[u8] {
        let start = self.checked(slot, 0, self.slot_bytes);
        // SAFETY: in bounds (checked); no writer overlaps (the caller's promise).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), self.slot_bytes) }
    }
}

impl Drop for SlotArena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_and_disjoint() {
        let a = SlotArena::new(3, 5000).unwrap();
        assert_eq!(a.slot_bytes(), 8192);
        for s in 0..3 {
            // SAFETY: single-threaded test, no other references.
            let w = unsafe { a.range_mut(s, 0, 8192) };
            assert_eq!(w.as_ptr() as usize % SLOT_ALIGN, 0);
            w.fill(s as u8 + 1);
        }
        for s in 0..3 {
            // SAFETY: no writer alive.
            assert!(unsafe { a.slot(s) }.iter().all(|b| *b == s as u8 + 1));
        }
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_ranges_panic() {
        let a = SlotArena::new(1, 4096).unwrap();
        // SAFETY: single-threaded test.
        let _ = unsafe { a.range_mut(0, 4000, 100) };
    }
}
