//! A minimal `io_uring` for the file device: read requests in, completions out,
//! all from the one thread that owns the device.
//!
//! The ring is set up with `IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN`
//! where the kernel has them (6.1+; plain flags otherwise): the kernel then posts
//! completions only when this thread asks for them (`io_uring_enter` with
//! `GETEVENTS`), so a finished read never interrupts the compute it overlaps, and
//! no I/O thread has to wake up to learn of it. `O_DIRECT` reads on a block device
//! are issued inline from the submitting call and complete from the device's
//! interrupt.
//!
//! Only the operations the device needs: [`Ring::push_read`] queues an
//! `IORING_OP_READ` of a file range into memory, [`Ring::enter`] submits queued
//! entries and optionally waits for completions, [`Ring::pop`] takes one.
//!
//! # Safety
//!
//! The submission and completion rings and the submission entries are shared
//! memory mapped from the ring's file descriptor. This module is their only user:
//! it writes an entry before publishing it with a release store of the
//! submission tail, reads a completion after an acquire load of the completion
//! tail and releases it with a release store of the completion head, the
//! protocol `io_uring(7)` specifies. The memory a read writes into is the
//! caller's obligation ([`Ring::push_read`] is `unsafe`).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, Ordering};

use rustix::io_uring::{
    io_uring_enter, io_uring_params, io_uring_setup, IoringEnterFlags, IoringFeatureFlags,
    IoringSetupFlags, IORING_OFF_SQES, IORING_OFF_SQ_RING,
};
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

/// `IORING_OP_READ` (`io_uring.h`).
const OP_READ: u8 = 22;

/// A submission queue entry as the kernel lays it out (64 bytes); the fields a
/// read uses, the rest zero.
#[repr(C)]
struct Sqe {
    opcode: u8,
    flags: u8,
    ioprio: u16,
    fd: i32,
    off: u64,
    addr: u64,
    len: u32,
    rw_flags: u32,
    user_data: u64,
    _rest: [u64; 3],
}

/// A completion queue entry (16 bytes).
#[repr(C)]
struct Cqe {
    user_data: u64,
    res: i32,
    flags: u32,
}

const _: () = assert!(std::mem::size_of::<Sqe>() == 64);
const _: () = assert!(std::mem::size_of::<Cqe>() == 16);

/// One mapping of the ring's memory.
struct Map {
    ptr: NonNull<c_void>,
    len: usize,
}

impl Map {
    fn new(fd: BorrowedFd<'_>, len: usize, offset: u64) -> io::Result<Map> {
        // SAFETY: a fresh shared mapping of the ring's file descriptor at a
        // kernel-defined offset; nothing else refers to the address range.
        let ptr = unsafe {
            mmap(
                ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::POPULATE,
                fd,
                offset,
            )
        }?;
        let ptr = NonNull::new(ptr).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Map { ptr, len })
    }

    /// The `u32` at byte `offset`, as an atomic.
    ///
    /// # Safety
    /// `offset` must be a 4-aligned offset the kernel reported inside the mapping.
    unsafe fn atomic(&self, offset: u32) -> &AtomicU32 {
        // SAFETY: per the contract; the kernel's ring fields are aligned u32s that
        // live as long as the mapping.
        unsafe {
            &*self
                .ptr
                .as_ptr()
                .cast::<u8>()
                .add(offset as usize)
                .cast::<AtomicU32>()
        }
    }

    /// A raw pointer to byte `offset`.
    fn at(&self, offset: u32) -> *mut u8 {
        debug_assert!((offset as usize) < self.len);
        // SAFETY: inside the mapping (callers pass kernel-reported offsets).
        unsafe { self.ptr.as_ptr().cast::<u8>().add(offset as usize) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `Map::new` and is unmapped once; the
        // ring that used it is being dropped.
        let _ = unsafe { munmap(self.ptr.as_ptr(), self.len) };
    }
}

/// An `io_uring` instance used by one thread.
pub(crate) struct Ring {
    // Field order: the mappings unmap before the descriptor closes.
    rings: Map,
    /// The completion ring, when the kernel maps it apart from the submission ring.
    cq_map: Option<Map>,
    sqes: Map,
    fd: OwnedFd,
    sq_entries: u32,
    sq_mask: u32,
    sq_head: u32,
    sq_tail: u32,
    sq_array: u32,
    cq_mask: u32,
    cq_head: u32,
    cq_tail: u32,
    cqes: u32,
    /// Entries written but not yet passed to the kernel.
    unsubmitted: u32,
    /// Our copy of the submission tail.
    tail: u32,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("entries", &self.sq_entries)
            .finish()
    }
}

impl Ring {
    /// A ring of at least `entries` submission entries (and twice as many
    /// completion entries).
    pub(crate) fn new(entries: u32) -> io::Result<Ring> {
        let setup = |flags: IoringSetupFlags| {
            let mut p = io_uring_params::default();
            p.flags = flags;
            // SAFETY: `p` is a valid, zero-initialized parameter block.
            unsafe { io_uring_setup(entries, &mut p) }.map(|fd| (fd, p))
        };
        let (fd, p) = setup(IoringSetupFlags::SINGLE_ISSUER | IoringSetupFlags::DEFER_TASKRUN)
            .or_else(|_| setup(IoringSetupFlags::empty()))?;
        let sq_len = p.sq_off.array as usize + p.sq_entries as usize * 4;
        let cq_len = p.cq_off.cqes as usize + p.cq_entries as usize * std::mem::size_of::<Cqe>();
        let single = p.features.contains(IoringFeatureFlags::SINGLE_MMAP);
        let rings = Map::new(
            fd.as_fd(),
            if single { sq_len.max(cq_len) } else { sq_len },
            IORING_OFF_SQ_RING,
        )?;
        let cq_map = if single {
            None
        } else {
            Some(Map::new(
                fd.as_fd(),
                cq_len,
                rustix::io_uring::IORING_OFF_CQ_RING,
            )?)
        };
        let sqes = Map::new(
            fd.as_fd(),
            p.sq_entries as usize * std::mem::size_of::<Sqe>(),
            IORING_OFF_SQES,
        )?;
        let mut ring = Ring {
            rings,
            cq_map,
            sqes,
            fd,
            sq_entries: p.sq_entries,
            sq_mask: 0,
            sq_head: p.sq_off.head,
            sq_tail: p.sq_off.tail,
            sq_array: p.sq_off.array,
            cq_mask: 0,
            cq_head: p.cq_off.head,
            cq_tail: p.cq_off.tail,
            cqes: p.cq_off.cqes,
            unsubmitted: 0,
            tail: 0,
        };
        // SAFETY: kernel-reported offsets of the ring fields.
        unsafe {
            ring.sq_mask = ring
                .rings
                .atomic(p.sq_off.ring_mask)
                .load(Ordering::Relaxed);
            ring.tail = ring.rings.atomic(p.sq_off.tail).load(Ordering::Relaxed);
            ring.cq_mask = ring.cq().atomic(p.cq_off.ring_mask).load(Ordering::Relaxed);
        }
        Ok(ring)
    }

    fn cq(&self) -> &Map {
        self.cq_map.as_ref().unwrap_or(&self.rings)
    }

    /// Submission entries free to fill.
    pub(crate) fn free(&self) -> u32 {
        // SAFETY: kernel-reported offset of the submission head.
        let head = unsafe { self.rings.atomic(self.sq_head) }.load(Ordering::Acquire);
        self.sq_entries - self.tail.wrapping_sub(head)
    }

    /// Queues a read of `len` bytes at `offset` of `fd` into `buf`, tagged
    /// `user_data`; `false` if the submission ring is full. Submitted by the next
    /// [`Ring::enter`].
    ///
    /// # Safety
    /// `buf` must be valid for writes of `len` bytes, and nothing may read or write
    /// it until the read's completion has been taken with [`Ring::pop`]; `fd` must
    /// stay open until then.
    pub(crate) unsafe fn push_read(
        &mut self,
        fd: BorrowedFd<'_>,
        buf: *mut u8,
        len: u32,
        offset: u64,
        user_data: u64,
    ) -> bool {
        if self.free() == 0 {
            return false;
        }
        let index = self.tail & self.sq_mask;
        let sqe = Sqe {
            opcode: OP_READ,
            flags: 0,
            ioprio: 0,
            fd: fd.as_raw_fd(),
            off: offset,
            addr: buf as u64,
            len,
            rw_flags: 0,
            user_data,
            _rest: [0; 3],
        };
        // SAFETY: `index` is inside the entry array, and the kernel does not read
        // entry `index` before the tail store below publishes it (the ring is not
        // full, so the kernel is done with it).
        unsafe {
            ptr::write_volatile(self.sqes.at(0).cast::<Sqe>().add(index as usize), sqe);
            ptr::write_volatile(
                self.rings
                    .at(self.sq_array)
                    .cast::<u32>()
                    .add(index as usize),
                index,
            );
        }
        self.tail = self.tail.wrapping_add(1);
        // SAFETY: kernel-reported offset of the submission tail.
        unsafe { self.rings.atomic(self.sq_tail) }.store(self.tail, Ordering::Release);
        self.unsubmitted += 1;
        true
    }

    /// Passes queued entries to the kernel and, with `wait`, blocks until at least
    /// one completion is ready. Always collects finished completions.
    pub(crate) fn enter(&mut self, wait: bool) -> io::Result<()> {
        // EAGAIN / EBUSY: the kernel is short of resources for now; without
        // completions to collect, try again shortly (for at most about a second).
        let mut busy_retries = 0u32;
        loop {
            let min = u32::from(wait && self.ready() == 0);
            // SAFETY: every queued entry's buffer is valid per `push_read`'s
            // contract; no extended arguments are passed.
            match unsafe {
                io_uring_enter(
                    self.fd.as_fd(),
                    self.unsubmitted,
                    min,
                    IoringEnterFlags::GETEVENTS,
                )
            } {
                Ok(n) => {
                    self.unsubmitted -= n.min(self.unsubmitted);
                    return Ok(());
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::BUSY)
                    if self.ready() > 0 || !wait =>
                {
                    return Ok(())
                }
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::BUSY)
                    if busy_retries < 10_000 =>
                {
                    busy_retries += 1;
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Completions waiting to be taken.
    fn ready(&self) -> u32 {
        // SAFETY: kernel-reported offsets of the completion head and tail.
        let (head, tail) = unsafe {
            (
                self.cq().atomic(self.cq_head).load(Ordering::Relaxed),
                self.cq().atomic(self.cq_tail).load(Ordering::Acquire),
            )
        };
        tail.wrapping_sub(head)
    }

    /// Takes one completion: its `user_data` and result (bytes read, or a negated
    /// `errno`).
    pub(crate) fn pop(&mut self) -> Option<(u64, i32)> {
        let cq = self.cq();
        // SAFETY: kernel-reported offsets of the completion head and tail.
        let (head_field, tail) = unsafe {
            (
                cq.atomic(self.cq_head),
                cq.atomic(self.cq_tail).load(Ordering::Acquire),
            )
        };
        let head = head_field.load(Ordering::Relaxed);
        if head == tail {
            return None;
        }
        // SAFETY: entry `head` is inside the completion array and was published by
        // the acquire load of the tail; it is read before the head moves past it.
        let cqe = unsafe {
            ptr::read_volatile(
                cq.at(self.cqes)
                    .cast::<Cqe>()
                    .add((head & self.cq_mask) as usize),
            )
        };
        head_field.store(head.wrapping_add(1), Ordering::Release);
        Some((cqe.user_data, cqe.res))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reads_a_file_through_the_ring() {
        let dir = std::env::temp_dir().join(format!("les-uring-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("data");
        let data: Vec<u8> = (0..20000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // Declared before the ring, so dropped after it if an assertion panics
        // with reads in flight.
        let mut bufs = vec![vec![0u8; 5000]; 4];
        let mut ring = Ring::new(4).expect("io_uring_setup");
        for (i, b) in bufs.iter_mut().enumerate() {
            // SAFETY: each buffer outlives its read (it is dropped after the
            // ring) and is not touched until its completion is popped.
            assert!(unsafe {
                ring.push_read(
                    file.as_fd(),
                    b.as_mut_ptr(),
                    5000,
                    i as u64 * 5000,
                    i as u64,
                )
            });
        }
        let mut seen = [false; 4];
        while seen.iter().any(|s| !s) {
            ring.enter(true).unwrap();
            while let Some((tag, res)) = ring.pop() {
                assert_eq!(res, 5000);
                seen[tag as usize] = true;
            }
        }
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(&b[..], &data[i * 5000..(i + 1) * 5000]);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
