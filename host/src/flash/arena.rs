//! Slot memory shared between the compute thread and the I/O threads.
//!
//! One page-aligned allocation holding every slot (runs of equally sized slots,
//! one run per size class, see `les_core::slot_classes`), written by I/O
//! threads (into slots whose reads are in flight) and read by the compute thread
//! (slots whose reads completed). Rust cannot see that these accesses never
//! overlap, so this module hands out raw ranges under a contract the file device
//! enforces with its own bookkeeping (see `FileDevice`): a range is written by
//! exactly one read in flight, and a slot is never read while any read into it is
//! in flight.
//!
//! The memory is an anonymous mapping aligned to 2 MiB, with transparent huge
//! pages requested on Linux: the compute streams every expert it uses from
//! here, and 4 KiB pages cost it a TLB miss per page; an O_DIRECT read into huge
//! pages also pins fewer pages and travels in fewer segments.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::ptr::NonNull;

use rustix::mm::{MapFlags, ProtFlags};

/// Alignment of every slot (O_DIRECT needs the logical block size; 4 KiB covers
/// every device seen in practice).
pub const SLOT_ALIGN: usize = 4096;

/// Alignment of the arena: a transparent huge page (elsewhere it only costs up
/// to this much address space).
const ARENA_ALIGN: usize = crate::hugepages::HUGE_PAGE;

/// A fixed pool of page-aligned slots, in runs of equally sized ones.
pub struct SlotArena {
    /// First byte of the arena, [`ARENA_ALIGN`]-aligned, inside `mapping`.
    ptr: NonNull<u8>,
    /// The whole anonymous mapping (the arena plus alignment slack), unmapped on drop.
    mapping: (NonNull<c_void>, usize),
    /// Per run: first slot, slots, bytes per slot, byte offset of its first slot.
    runs: Vec<Run>,
    n_slots: usize,
}

#[derive(Clone, Copy)]
struct Run {
    first: usize,
    slots: usize,
    bytes: usize,
    base: usize,
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
        Self::with_runs(&[(n_slots, slot_bytes)])
    }

    /// Allocates runs of `(slots, bytes)` zeroed slots, each slot rounded up to
    /// [`SLOT_ALIGN`], numbered in order. `None` if the size overflows or
    /// allocation fails.
    pub fn with_runs(runs: &[(usize, usize)]) -> Option<SlotArena> {
        let mut out = Vec::with_capacity(runs.len());
        let (mut first, mut base) = (0usize, 0usize);
        for &(slots, bytes) in runs {
            let bytes = bytes.max(1).checked_next_multiple_of(SLOT_ALIGN)?;
            out.push(Run {
                first,
                slots,
                bytes,
                base,
            });
            first = first.checked_add(slots)?;
            base = base.checked_add(bytes.checked_mul(slots)?)?;
        }
        let len = base.max(1).checked_next_multiple_of(ARENA_ALIGN)?;
        let map_len = len.checked_add(ARENA_ALIGN)?;
        // SAFETY: a fresh private anonymous mapping (zero-filled) that no other
        // code knows of; the kernel picks the address.
        let map = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .ok()?;
        let mapping = (NonNull::new(map)?, map_len);
        let skip = (map as usize).next_multiple_of(ARENA_ALIGN) - map as usize;
        // SAFETY: `skip < ARENA_ALIGN`, so `skip + len <= map_len`: inside the mapping.
        let ptr = NonNull::new(unsafe { map.cast::<u8>().add(skip) })?;
        let arena = SlotArena {
            ptr,
            mapping,
            runs: out,
            n_slots: first,
        };
        // SAFETY: `ptr..ptr + len` is inside the mapping, untouched, and no
        // other reference to it exists yet.
        crate::hugepages::advise(unsafe {
            std::slice::from_raw_parts_mut(ptr.as_ptr().cast::<std::mem::MaybeUninit<u8>>(), len)
        });
        // Out of memory now, not at an OOM kill mid-decode (dropping the arena
        // unmaps it).
        populate(ptr, len).then_some(arena)
    }

    /// The address of the first slot (to tell whether the memory is still
    /// mapped, in tests).
    #[cfg(test)]
    pub fn address(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Bytes of the largest slot (a multiple of [`SLOT_ALIGN`]).
    pub fn slot_bytes(&self) -> usize {
        self.runs.iter().map(|r| r.bytes).max().unwrap_or(0)
    }

    /// Bytes of slot `slot` (0 beyond the last).
    pub fn slot_len(&self, slot: usize) -> usize {
        self.run(slot).map_or(0, |r| r.bytes)
    }

    /// Number of slots.
    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// Bytes of slots (the sum of every slot's [`slot_len`](Self::slot_len)).
    pub fn total_bytes(&self) -> usize {
        self.runs.iter().map(|r| r.slots * r.bytes).sum()
    }

    fn run(&self, slot: usize) -> Option<&Run> {
        self.runs
            .iter()
            .find(|r| (r.first..r.first + r.slots).contains(&slot))
    }

    fn checked(&self, slot: usize, offset: usize, len: usize) -> usize {
        let run = self.run(slot);
        let r = run.filter(|r| offset.checked_add(len).is_some_and(|e| e <= r.bytes));
        let Some(r) = r else {
            panic!("slot range out of bounds: slot {slot} offset {offset} len {len}");
        };
        r.base + (slot - r.first) * r.bytes + offset
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
        let len = self.slot_len(slot);
        let start = self.checked(slot, 0, len);
        // SAFETY: in bounds (checked); no writer overlaps (the caller's promise).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len) }
    }

    /// The first `len` bytes of slot `slot` (at most its size), for reading.
    ///
    /// # Safety
    /// No `range_mut` of this slot overlapping those bytes may be alive while the
    /// returned slice lives.
    pub unsafe fn prefix(&self, slot: usize, len: usize) -> &[u8] {
        let len = len.min(self.slot_len(slot));
        let start = self.checked(slot, 0, len);
        // SAFETY: in bounds (checked); no writer overlaps (the caller's promise).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len) }
    }
}

/// Faults the arena in now (`MADV_POPULATE_WRITE`, or one write per page where
/// the kernel lacks it), so that the decode's first reads into each slot do not
/// wait for page faults, huge-page zeroing and compaction. `false` when the
/// kernel has too little memory for it.
fn populate(ptr: NonNull<u8>, len: usize) -> bool {
    populate_parallel(ptr, len, POPULATE_PER_THREAD)
}

/// [`populate`] on up to one thread per CPU (at most 8), each taking at least
/// `per_thread` bytes: faulting in is the kernel zeroing pages and, on a
/// virtual machine, the host backing them, which goes faster on several CPUs
/// (4 GiB of slots on this project's 2-CPU VM, alternating runs: 0.32-0.55 s
/// on two threads but for one 2.0 s, against 0.52-4.9 s, median 1.9 s, on one).
fn populate_parallel(ptr: NonNull<u8>, len: usize, per_thread: usize) -> bool {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(len / per_thread.max(1))
        .clamp(1, 8);
    if threads > 1 {
        let part = len.div_ceil(threads).next_multiple_of(ARENA_ALIGN);
        let base = ptr.as_ptr() as usize;
        return std::thread::scope(|s| {
            let handles: Vec<_> = (0..len)
                .step_by(part)
                .map(|start| {
                    let n = part.min(len - start);
                    // The address as an integer: threads populate disjoint parts.
                    let at = base + start;
                    s.spawn(move || {
                        NonNull::new(at as *mut u8).is_some_and(|p| populate_range(p, n))
                    })
                })
                .collect();
            handles.into_iter().all(|h| h.join().unwrap_or(false))
        });
    }
    populate_range(ptr, len)
}

/// Least a thread populates: smaller arenas are populated on one thread.
const POPULATE_PER_THREAD: usize = 256 << 20;

/// [`populate`] of `len` bytes from `ptr`, on this thread.
fn populate_range(ptr: NonNull<u8>, len: usize) -> bool {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: advice over a range of our own fresh mapping; populating
        // writable private memory keeps its contents (zeros).
        let advised = unsafe {
            rustix::mm::madvise(
                ptr.as_ptr().cast(),
                len,
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        };
        match advised {
            Ok(()) => return true,
            Err(e) if e == rustix::io::Errno::NOMEM => return false,
            // EINVAL before Linux 5.14: touch the pages instead.
            Err(_) => {}
        }
    }
    for offset in (0..len).step_by(SLOT_ALIGN) {
        // SAFETY: `offset < len`, inside the mapping, which nothing else
        // references yet; the byte is zero and stays zero.
        unsafe { ptr.as_ptr().add(offset).write_volatile(0) };
    }
    true
}

impl Drop for SlotArena {
    fn drop(&mut self) {
        let (map, map_len) = self.mapping;
        // SAFETY: mapped in `with_runs` with this length, unmapped once. No
        // slice into it outlives `self` (they borrow it); reads handed to the
        // kernel by address (io_uring) are drained before the arena is
        // dropped, or the arena is leaked (`FileDevice`'s drop).
        let _ = unsafe { rustix::mm::munmap(map.as_ptr(), map_len) };
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
    fn runs_of_sizes_are_aligned_disjoint_and_exact() {
        let a = SlotArena::with_runs(&[(2, 5000), (0, 9000), (3, 9000)]).unwrap();
        assert_eq!((a.n_slots(), a.slot_bytes()), (5, 12288));
        assert_eq!(a.total_bytes(), 2 * 8192 + 3 * 12288);
        let lens: Vec<usize> = (0..6).map(|s| a.slot_len(s)).collect();
        assert_eq!(lens, [8192, 8192, 12288, 12288, 12288, 0]);
        for s in 0..5 {
            // SAFETY: single-threaded test, no other references.
            let w = unsafe { a.range_mut(s, 0, a.slot_len(s)) };
            assert_eq!(w.as_ptr() as usize % SLOT_ALIGN, 0);
            w.fill(s as u8 + 1);
        }
        for s in 0..5 {
            // SAFETY: no writer alive.
            let r = unsafe { a.slot(s) };
            assert_eq!(r.len(), a.slot_len(s));
            assert!(r.iter().all(|b| *b == s as u8 + 1));
        }
    }

    #[test]
    fn the_arena_starts_zeroed_on_a_huge_page_boundary() {
        let a = SlotArena::with_runs(&[(3, 3 << 20), (2, 5000)]).unwrap();
        // SAFETY: no writer alive.
        let first = unsafe { a.slot(0) };
        assert_eq!(first.as_ptr() as usize % ARENA_ALIGN, 0);
        for s in 0..a.n_slots() {
            // SAFETY: no writer alive.
            assert!(unsafe { a.slot(s) }.iter().all(|b| *b == 0), "slot {s}");
        }
    }

    #[test]
    fn several_threads_populate_every_part_and_nothing_past_it() {
        // Sizes that do not split evenly into parts, with parts of at least
        // 1 MiB: a part reaching past the mapping fails (ENOMEM).
        for len in [(9 << 20) + 4096, 3 << 20, 4096] {
            // SAFETY: a fresh private anonymous mapping nothing else knows of.
            let map = unsafe {
                rustix::mm::mmap_anonymous(
                    std::ptr::null_mut(),
                    len,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::PRIVATE,
                )
            }
            .unwrap();
            let ptr = NonNull::new(map.cast::<u8>()).unwrap();
            assert!(populate_parallel(ptr, len, 1 << 20), "{len}");
            // SAFETY: inside the mapping, no other reference to it.
            let bytes = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
            assert!(bytes.iter().all(|b| *b == 0));
            bytes.fill(7);
            // SAFETY: mapped just above with this length; `bytes` is not used again.
            unsafe { rustix::mm::munmap(map, len) }.unwrap();
        }
    }

    #[test]
    fn an_arena_beyond_memory_is_refused() {
        // 1 PiB: the kernel refuses the mapping or its population.
        assert!(SlotArena::new(1 << 20, 1 << 30).is_none());
        assert!(SlotArena::new(usize::MAX / 2, 1 << 20).is_none());
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn a_range_past_its_smaller_slot_panics() {
        let a = SlotArena::with_runs(&[(1, 4096), (1, 8192)]).unwrap();
        // SAFETY: single-threaded test.
        let _ = unsafe { a.range_mut(0, 4000, 200) };
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_ranges_panic() {
        let a = SlotArena::new(1, 4096).unwrap();
        // SAFETY: single-threaded test.
        let _ = unsafe { a.range_mut(0, 4000, 100) };
    }
}
