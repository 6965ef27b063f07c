//! Experts on flash: a [`BlockDevice`] over a real file.
//!
//! [`FileDevice`] reads with `pread` on a pool of I/O threads, several reads in
//! flight, demand ("urgent") reads served before queued prefetches. With
//! [`IoEngine::Uring`] it issues the same reads through an `io_uring` driven by
//! the thread that owns the device instead (`flash/uring.rs`): no I/O threads, so no
//! thread wakes up per read and preempts the compute it overlaps, but a finished
//! read is only noticed, and the next one started, when the device is polled or
//! waited on. Prefetches then keep at most `threads` reads in the ring, demand
//! reads up to as many again, so a demand read never waits in our queue behind
//! prefetches. It opens the
//! file with `O_DIRECT` so the page cache does not become a hidden second expert
//! cache: aligned requests go straight into the (page-aligned) slot, unaligned
//! ones (plain GGUFs, whose experts are not 4 KiB-aligned) through a per-thread
//! aligned bounce buffer. Where `O_DIRECT` is refused (tmpfs, some filesystems), it
//! falls back to buffered reads and drops the pages it read with
//! `posix_fadvise(DONTNEED)`.
//!
//! Large aligned reads are split into chunks ([`FileDeviceConfig::chunk_bytes`])
//! that the I/O threads read in parallel: one expert arrives sooner than from a
//! single thread, and a demand read waits behind at most one chunk of a prefetch,
//! not a whole expert. The read completes when its last chunk has.
//!
//! Reads can be checked where they land: given [`ReadChecks`] (the CRC-32 of
//! each packed expert), the I/O thread that read a chunk hashes it, the chunks'
//! CRCs are combined when the read completes, and a mismatch completes the read
//! as failed ([`io::ErrorKind::InvalidData`], "checksum mismatch"). `les` itself
//! does not ask for this: it checks each expert where it is first computed
//! (`SchedulerConfig::verify_on_compute`), from bytes already in cache, which on
//! few cores costs the overlapped compute less than hashing every read from
//! RAM here; with spare cores, checking here takes the hashing off the compute
//! threads.
//!
//! Given a [`Trace`] ([`FileDevice::trace_into`]), the device records each
//! finished chunk (its I/O thread or ring place, demand or prefetch, bytes)
//! and each `wait` of the computation: `les bench --trace`.
//!
//! Soundness of the shared slot memory ([`arena`]) rests on bookkeeping done here,
//! not on the caller: `submit` rejects a read overlapping another read in flight
//! into the same slot, and [`SlotMemory::slot`] refuses a slot with a read in
//! flight. A read's bytes are written only while it is in flight, and it leaves
//! the in-flight set only in `poll`, after its I/O thread finished writing.

pub mod arena;
pub mod faults;
#[cfg(any(target_os = "linux", target_os = "android"))]
mod uring;

use std::collections::VecDeque;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use les_core::blockdev::{
    Alignment, BlockDevice, Completion, DeviceError, ReadRequest, ReadStatus, SlotId, SlotMemory,
    SubmitError, Tag,
};
use les_core::slot_classes::SlotClass;

use crate::trace::{Trace, What};

use arena::{SlotArena, SLOT_ALIGN};

/// An I/O error of the file device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileError {
    /// The OS error kind (or `UnexpectedEof` for a short read).
    pub kind: io::ErrorKind,
    /// What failed, for the user.
    pub message: String,
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FileError {}

impl DeviceError for FileError {
    fn is_transient(&self) -> bool {
        matches!(
            self.kind,
            io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        )
    }
}

fn file_error(kind: io::ErrorKind, message: impl Into<String>) -> FileError {
    FileError {
        kind,
        message: message.into(),
    }
}

/// Default [`FileDeviceConfig::chunk_bytes`]: large enough to stream at the
/// device's speed, small enough that an expert of a few MiB spreads over the
/// I/O threads.
pub const DEFAULT_CHUNK_BYTES: usize = 512 * 1024;

/// What the bytes of one read must hash to: the CRC-32
/// ([`les_core::layout::checksum`]) of its first `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Check {
    /// Bytes covered, from the start of the read (at most the read's length).
    pub len: u32,
    /// Their CRC-32.
    pub crc: u32,
}

/// The [`Check`] of every read that starts at a given file offset (e.g. each
/// packed expert's extent); reads at other offsets are not checked.
#[derive(Clone, Debug, Default)]
pub struct ReadChecks {
    /// Sorted by offset, offsets unique.
    by_offset: Vec<(u64, Check)>,
}

impl ReadChecks {
    /// Checks from `(file offset, check)` pairs; a repeated offset keeps its
    /// last check.
    pub fn new(mut checks: Vec<(u64, Check)>) -> ReadChecks {
        checks.sort_by_key(|(o, _)| *o);
        checks.dedup_by(|later, earlier| {
            let same = later.0 == earlier.0;
            if same {
                earlier.1 = later.1;
            }
            same
        });
        ReadChecks { by_offset: checks }
    }

    /// The check of a read starting at `offset`.
    pub fn at(&self, offset: u64) -> Option<Check> {
        let i = self
            .by_offset
            .binary_search_by_key(&offset, |(o, _)| *o)
            .ok()?;
        Some(self.by_offset[i].1)
    }

    /// How many reads are checked.
    pub fn len(&self) -> usize {
        self.by_offset.len()
    }

    /// Whether no read is checked.
    pub fn is_empty(&self) -> bool {
        self.by_offset.is_empty()
    }
}

/// How a [`FileDevice`] issues its reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoEngine {
    /// `io_uring` where the kernel allows it (direct I/O only), else threads
    /// (see [`FileDeviceConfig::for_reads`] for the choice by read size).
    Auto,
    /// A pool of I/O threads doing blocking `pread`s.
    Threads,
    /// `io_uring`, driven by the thread that owns the device; an error if the
    /// kernel refuses it or the file cannot be read with `O_DIRECT`.
    Uring,
}

/// Settings of a [`FileDevice`].
#[derive(Clone, Copy, Debug)]
pub struct FileDeviceConfig {
    /// How reads are issued.
    pub engine: IoEngine,
    /// I/O threads (reads in parallel); with `io_uring`, reads in the ring at once.
    pub threads: usize,
    /// Reads accepted at once.
    pub queue_depth: usize,
    /// Try `O_DIRECT`.
    pub direct: bool,
    /// Split aligned reads longer than this into chunks read in parallel (rounded
    /// down to a multiple of 4 KiB; 0 = never split).
    pub chunk_bytes: usize,
}

impl FileDeviceConfig {
    /// Settles [`IoEngine::Auto`] for reads of at most `largest` bytes (an
    /// expert): it stays `Auto` (`io_uring` where allowed) when each is one
    /// read of at most the chunk size ([`DEFAULT_CHUNK_BYTES`] where reads are
    /// not split), and becomes [`IoEngine::Threads`] for larger ones.
    ///
    /// Measured on a 2-vCPU VM (README): for one-read experts `io_uring` halved
    /// the stall, since its reads start inline in the submitting call, while an
    /// I/O thread first has to be woken and scheduled on cores busy computing;
    /// for experts of several chunks, whose reads keep the device busy for most
    /// of a layer, the threads stalled less, since they start the next chunk
    /// the moment one finishes, where the ring only refills when the compute
    /// thread polls it. Other engines are returned as they are.
    pub fn for_reads(self, largest: usize) -> Self {
        let one_read = match self.chunk_bytes {
            0 => DEFAULT_CHUNK_BYTES,
            c => c,
        };
        match self.engine {
            IoEngine::Auto if largest > one_read => FileDeviceConfig {
                engine: IoEngine::Threads,
                ..self
            },
            _ => self,
        }
    }
}

impl Default for FileDeviceConfig {
    fn default() -> Self {
        FileDeviceConfig {
            engine: IoEngine::Threads,
            threads: 4,
            queue_depth: 32,
            direct: true,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
        }
    }
}

/// Counters of a [`FileDevice`].
#[derive(Debug, Default)]
pub struct IoCounters {
    /// Bytes delivered into slots.
    pub bytes: AtomicU64,
    /// Bytes read from the file (more than `bytes` when unaligned reads are widened).
    pub file_bytes: AtomicU64,
    /// Reads completed (each chunk of a split read counts).
    pub reads: AtomicU64,
    /// Sum over reads of their duration, in nanoseconds.
    pub read_nanos: AtomicU64,
    /// Time the compute thread spent blocked in `wait`, in nanoseconds.
    pub stall_nanos: AtomicU64,
    /// Time with at least one chunk submitted and not yet finished (read,
    /// failed or dropped), in nanoseconds: how long the device had work. Its
    /// share of the wall time says how much bandwidth was left idle. With
    /// `io_uring` a chunk finishes when its completion is collected, so a
    /// read done between two polls counts until the second.
    pub busy_nanos: AtomicU64,
}

impl IoCounters {
    /// A copy of the counters now.
    pub fn snapshot(&self) -> IoSnapshot {
        IoSnapshot {
            bytes: self.bytes.load(Ordering::Relaxed),
            file_bytes: self.file_bytes.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            read_nanos: self.read_nanos.load(Ordering::Relaxed),
            stall_nanos: self.stall_nanos.load(Ordering::Relaxed),
            busy_nanos: self.busy_nanos.load(Ordering::Relaxed),
        }
    }
}

/// Values of [`IoCounters`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoSnapshot {
    /// Bytes delivered into slots.
    pub bytes: u64,
    /// Bytes read from the file.
    pub file_bytes: u64,
    /// Reads completed.
    pub reads: u64,
    /// Sum of read durations (ns).
    pub read_nanos: u64,
    /// Time blocked waiting for reads (ns).
    pub stall_nanos: u64,
    /// Time with reads outstanding (ns).
    pub busy_nanos: u64,
}

impl std::ops::Sub for IoSnapshot {
    type Output = IoSnapshot;
    fn sub(self, o: IoSnapshot) -> IoSnapshot {
        IoSnapshot {
            bytes: self.bytes - o.bytes,
            file_bytes: self.file_bytes - o.file_bytes,
            reads: self.reads - o.reads,
            read_nanos: self.read_nanos - o.read_nanos,
            stall_nanos: self.stall_nanos - o.stall_nanos,
            busy_nanos: self.busy_nanos - o.busy_nanos,
        }
    }
}

/// One request as the I/O threads see it: the whole read or one chunk of it.
struct Job {
    /// The chunk: offsets and length of this piece, tag of the whole read.
    req: ReadRequest,
    group: Arc<Group>,
    /// Which chunk of the read this is.
    index: usize,
    /// Bytes of this chunk to hash (those inside the read's [`Check`]).
    hash_len: usize,
    /// Bytes already read (a short `io_uring` read continues from here).
    progress: u32,
    /// The place in the `io_uring` it runs in (for [`Trace`]).
    lane: u16,
}

/// The chunks of one submitted read.
struct Group {
    /// Chunks not yet finished (read, failed or dropped).
    remaining: AtomicU64,
    /// Some chunk was dropped by a cancel: the read completes as cancelled.
    dropped: AtomicBool,
    /// The first error of a chunk.
    error: Mutex<Option<FileError>>,
    /// What the read must hash to, with the file offset for the error message.
    check: Option<(Check, u64)>,
    /// Per chunk: the CRC-32 of its hashed bytes and how many (checked reads).
    crcs: Mutex<Vec<(u32, u64)>>,
}

impl Group {
    /// Marks one chunk finished; the completion when it was the last.
    fn finish(&self, tag: Tag) -> Option<Completion<FileError>> {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return None;
        }
        let status = match lock(&self.error).take() {
            Some(e) => ReadStatus::Failed(e),
            None if self.dropped.load(Ordering::Acquire) => ReadStatus::Cancelled,
            None => match self.check {
                Some((check, offset)) if !self.intact(check) => ReadStatus::Failed(file_error(
                    io::ErrorKind::InvalidData,
                    format!(
                        "checksum mismatch: the {} bytes read at offset {offset} are corrupt",
                        check.len
                    ),
                )),
                _ => ReadStatus::Done,
            },
        };
        Some(Completion { tag, status })
    }

    /// Whether the chunks' CRCs, combined in order, give the expected one.
    fn intact(&self, check: Check) -> bool {
        let crcs = lock(&self.crcs);
        let mut h = crc32fast::Hasher::new();
        let mut hashed = 0u64;
        for &(crc, len) in crcs.iter().filter(|(_, len)| *len > 0) {
            h.combine(&crc32fast::Hasher::new_with_initial_len(crc, len));
            hashed += len;
        }
        hashed == check.len as u64 && h.finalize() == check.crc
    }
}

/// Chunks waiting for an I/O thread or a place in the ring, demand chunks first.
#[derive(Default)]
struct Jobs {
    urgent: VecDeque<Job>,
    normal: VecDeque<Job>,
}

impl Jobs {
    /// Queues the chunks of one read.
    fn push(&mut self, urgent: bool, jobs: impl IntoIterator<Item = Job>) {
        if urgent {
            self.urgent.extend(jobs);
        } else {
            self.normal.extend(jobs);
        }
    }

    /// The next chunk to start: the oldest demand chunk, else the oldest prefetch.
    fn pop(&mut self) -> Option<Job> {
        self.urgent.pop_front().or_else(|| self.normal.pop_front())
    }

    /// The oldest demand chunk.
    fn pop_urgent(&mut self) -> Option<Job> {
        self.urgent.pop_front()
    }

    /// Removes the chunks of read `tag`; their reads' chunk groups.
    fn take(&mut self, tag: Tag) -> Vec<Arc<Group>> {
        let mut dropped = Vec::new();
        for d in [&mut self.urgent, &mut self.normal] {
            d.retain(|j| {
                if j.req.tag == tag {
                    dropped.push(Arc::clone(&j.group));
                    false
                } else {
                    true
                }
            });
        }
        dropped
    }

    /// Removes every chunk.
    fn drain(&mut self) -> impl Iterator<Item = Job> + '_ {
        self.urgent.drain(..).chain(self.normal.drain(..))
    }

    /// Drops every chunk.
    fn clear(&mut self) {
        self.urgent.clear();
        self.normal.clear();
    }
}

struct Queue {
    jobs: Jobs,
    shutdown: bool,
}

/// Chunks outstanding, and since when there were any: the clock behind
/// [`IoCounters::busy_nanos`].
struct BusyClock {
    outstanding: u64,
    since: Instant,
}

struct Shared {
    arena: SlotArena,
    file: File,
    direct: bool,
    file_len: u64,
    queue: Mutex<Queue>,
    work: Condvar,
    done: Mutex<VecDeque<Completion<FileError>>>,
    done_cv: Condvar,
    counters: IoCounters,
    busy: Mutex<BusyClock>,
    /// Where reads and stalls are recorded, once set ([`FileDevice::trace_into`]).
    trace: OnceLock<Trace>,
}

impl Shared {
    /// `n` chunks were submitted.
    fn chunks_started(&self, n: u64) {
        let mut b = lock(&self.busy);
        if b.outstanding == 0 {
            b.since = Instant::now();
        }
        b.outstanding += n;
    }

    /// `n` chunks finished (read, failed or dropped by a cancel).
    fn chunks_ended(&self, n: u64) {
        let mut b = lock(&self.busy);
        b.outstanding = b.outstanding.saturating_sub(n);
        if b.outstanding == 0 && n > 0 {
            let busy = b.since.elapsed().as_nanos() as u64;
            self.counters.busy_nanos.fetch_add(busy, Ordering::Relaxed);
        }
    }

    /// Records a finished read of `req` on `lane` that started at `start`.
    fn trace_read(&self, lane: usize, req: &ReadRequest, start: Instant) {
        if let Some(t) = self.trace.get() {
            let what = What::Read {
                lane: lane as u16,
                urgent: req.urgent,
                bytes: req.len,
            };
            t.span(what, start, Instant::now());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means an I/O thread panicked; the data (queues) stays valid.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    tag: Tag,
    slot: u32,
    /// The bytes of the slot it writes (64-bit: a slot of 4 GiB ends at 2^32).
    start: u64,
    end: u64,
}

/// A [`BlockDevice`] reading a file into a fixed arena of slots.
///
/// It stays on the thread that opened it: with `io_uring`, its ring accepts
/// submissions from that thread only (set up `SINGLE_ISSUER`), so the type is
/// not `Send`.
///
/// ```compile_fail
/// fn on_another_thread<T: Send>() {}
/// on_another_thread::<les::flash::FileDevice>();
/// ```
pub struct FileDevice {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// The `io_uring` engine, when it issues the reads (no workers then).
    #[cfg(any(target_os = "linux", target_os = "android"))]
    uring: Option<UringEngine>,
    queue_depth: usize,
    chunk_bytes: usize,
    in_flight: Vec<InFlight>,
    checks: ReadChecks,
}

impl fmt::Debug for FileDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileDevice")
            .field("direct", &self.shared.direct)
            .field("slots", &self.shared.arena.n_slots())
            .field("slot_bytes", &self.shared.arena.slot_bytes())
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl FileDevice {
    /// Opens `path` for reading into `n_slots` slots of `slot_bytes` bytes.
    pub fn open(
        path: &Path,
        n_slots: usize,
        slot_bytes: usize,
        config: FileDeviceConfig,
    ) -> io::Result<FileDevice> {
        let class = SlotClass {
            slots: u32::try_from(n_slots).map_err(|_| too_many())?,
            bytes: u32::try_from(slot_bytes).map_err(|_| too_many())?,
        };
        Self::open_classes(path, &[class], config)
    }

    /// Opens `path` for reading into slots of several sizes: the runs of
    /// `classes`, numbered in order (as the scheduler's
    /// `Scheduler::with_slot_classes` numbers them).
    pub fn open_classes(
        path: &Path,
        classes: &[SlotClass],
        config: FileDeviceConfig,
    ) -> io::Result<FileDevice> {
        let buffered = File::open(path)?;
        let file_len = buffered.metadata()?.len();
        let (file, direct) = if config.direct {
            match OpenOptions::new()
                .read(true)
                .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
                .open(path)
            {
                Ok(f) if probe_direct(&f, file_len) => (f, true),
                _ => (buffered, false),
            }
        } else {
            (buffered, false)
        };
        let runs: Vec<(usize, usize)> = classes
            .iter()
            .map(|c| (c.slots as usize, c.bytes as usize))
            .collect();
        let arena = SlotArena::with_runs(&runs).ok_or_else(|| {
            let total: u128 = classes
                .iter()
                .map(|c| c.slots as u128 * c.bytes as u128)
                .sum();
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!(
                    "cannot allocate {} slots ({total} bytes)",
                    classes.iter().map(|c| c.slots as u64).sum::<u64>()
                ),
            )
        })?;
        let shared = Arc::new(Shared {
            arena,
            file,
            direct,
            file_len,
            queue: Mutex::new(Queue {
                jobs: Jobs::default(),
                shutdown: false,
            }),
            work: Condvar::new(),
            done: Mutex::new(VecDeque::new()),
            done_cv: Condvar::new(),
            counters: IoCounters::default(),
            busy: Mutex::new(BusyClock {
                outstanding: 0,
                since: Instant::now(),
            }),
            trace: OnceLock::new(),
        });
        let max_read = shared.arena.slot_bytes() + 2 * SLOT_ALIGN;
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let uring = match config.engine {
            IoEngine::Threads => None,
            IoEngine::Auto if !direct => None,
            IoEngine::Uring if !direct => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "io_uring needs O_DIRECT reads, which this file refuses",
                ))
            }
            IoEngine::Auto => UringEngine::new(config.threads, max_read).ok(),
            IoEngine::Uring => Some(UringEngine::new(config.threads, max_read)?),
        };
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        if config.engine == IoEngine::Uring {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "io_uring exists only on Linux",
            ));
        }
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let n_workers = if uring.is_some() {
            0
        } else {
            config.threads.max(1)
        };
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        let n_workers = config.threads.max(1);
        let mut device = FileDevice {
            shared,
            workers: Vec::with_capacity(n_workers),
            #[cfg(any(target_os = "linux", target_os = "android"))]
            uring,
            queue_depth: config.queue_depth.max(1),
            chunk_bytes: config.chunk_bytes / SLOT_ALIGN * SLOT_ALIGN,
            in_flight: Vec::new(),
            checks: ReadChecks::default(),
        };
        for i in 0..n_workers {
            let s = Arc::clone(&device.shared);
            // On failure the device drops: it stops and joins the threads
            // already started, and frees its memory.
            let w = std::thread::Builder::new()
                .name(format!("les-io-{i}"))
                .spawn(move || worker(&s, max_read, i))?;
            device.workers.push(w);
        }
        Ok(device)
    }

    /// Checks every later read that starts at an offset of `checks` on the I/O
    /// threads (see the module documentation).
    pub fn set_checks(&mut self, checks: ReadChecks) {
        self.checks = checks;
    }

    /// Whether reads bypass the page cache with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.shared.direct
    }

    /// Whether reads go through `io_uring` (else through I/O threads).
    pub fn uses_uring(&self) -> bool {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        return self.uring.is_some();
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        false
    }

    /// The engine that issues the reads: `"uring"` or `"threads"`.
    pub fn engine_name(&self) -> &'static str {
        if self.uses_uring() {
            "uring"
        } else {
            "threads"
        }
    }

    /// With `io_uring`: blocks until a read completes (or none is running);
    /// `false` without it.
    fn wait_on_ring(&mut self) -> bool {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Some(u) = self.uring.as_mut() {
            while u.done.is_empty() && u.is_running() {
                u.service(&self.shared, true);
            }
            return true;
        }
        false
    }

    /// Bytes of the largest slot.
    pub fn slot_bytes(&self) -> usize {
        self.shared.arena.slot_bytes()
    }

    /// I/O counters.
    pub fn counters(&self) -> &IoCounters {
        &self.shared.counters
    }

    /// The counters now, with the device's busy time up to this moment: a
    /// stretch with reads still outstanding counts so far (the counters add a
    /// stretch only when it ends), so the difference of two snapshots is the
    /// busy time between them.
    pub fn io_snapshot(&self) -> IoSnapshot {
        let b = lock(&self.shared.busy);
        // Under the clock's lock, no stretch can end (and be added) meanwhile.
        let mut s = self.shared.counters.snapshot();
        if b.outstanding > 0 {
            s.busy_nanos += b.since.elapsed().as_nanos() as u64;
        }
        s
    }

    /// Whether the kernel may still write some of `slot`'s first `len` bytes: a
    /// read the failed ring held there ([`UringEngine::held`]).
    fn kernel_may_write(&self, slot: u32, len: u64) -> bool {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Some(u) = &self.uring {
            return u.held.iter().any(|&(s, start)| s == slot && start < len);
        }
        let _ = (slot, len);
        false
    }

    /// Records every read that finishes and every stall from now on into
    /// `trace` (once per device: false, and nothing changes, if it already
    /// records into one).
    pub fn trace_into(&self, trace: Trace) -> bool {
        self.shared.trace.set(trace).is_ok()
    }

    /// Drops the file's pages from the page cache (before a benchmark run).
    pub fn evict_page_cache(path: &Path) -> io::Result<()> {
        let f = File::open(path)?;
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed)?;
        Ok(())
    }
}

#[allow(unsafe_code)]
/// Whether an aligned `O_DIRECT` read works on this file (some filesystems accept
/// the flag at open and fail every read).
fn probe_direct(f: &File, file_len: u64) -> bool {
    if file_len < SLOT_ALIGN as u64 {
        return false;
    }
    let Some(buf) = SlotArena::new(1, SLOT_ALIGN) else {
        return false;
    };
    // SAFETY: `buf` is local to this function; this is its only reference.
    let dst = unsafe { buf.range_mut(0, 0, SLOT_ALIGN) };
    f.read_at(dst, 0).is_ok()
}

fn worker(s: &Shared, max_read: usize, lane: usize) {
    // Bounce buffer for unaligned O_DIRECT reads, used by this thread only.
    let bounce = if s.direct {
        SlotArena::new(1, max_read)
    } else {
        None
    };
    loop {
        let Job {
            req,
            group,
            index,
            hash_len,
            ..
        } = {
            let mut q = lock(&s.queue);
            loop {
                if let Some(j) = q.jobs.pop() {
                    break j;
                }
                if q.shutdown {
                    return;
                }
                q = s.work.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let start = Instant::now();
        // A panic here (none is known) must not leave the read unfinished and
        // its waiter blocked forever: it fails the read instead.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            read(s, &req, bounce.as_ref(), hash_len)
        }))
        .unwrap_or_else(|_| {
            Err(file_error(
                io::ErrorKind::Other,
                format!(
                    "the I/O thread reading {} bytes at offset {} panicked",
                    req.len, req.offset
                ),
            ))
        });
        match result {
            Ok((file_bytes, crc)) => {
                let c = &s.counters;
                c.bytes.fetch_add(req.len as u64, Ordering::Relaxed);
                c.file_bytes.fetch_add(file_bytes, Ordering::Relaxed);
                if let Some(slot) = lock(&group.crcs).get_mut(index) {
                    *slot = (crc, hash_len as u64);
                }
            }
            Err(e) => {
                lock(&group.error).get_or_insert(e);
            }
        }
        s.counters.reads.fetch_add(1, Ordering::Relaxed);
        s.counters
            .read_nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        s.trace_read(lane, &req, start);
        // Before the completion is published: whoever sees it sees the clock
        // stopped.
        s.chunks_ended(1);
        if let Some(c) = group.finish(req.tag) {
            lock(&s.done).push_back(c);
            s.done_cv.notify_all();
        }
    }
}

/// Reads through `io_uring` from the thread that owns the device: jobs wait in
/// the engine's own queues (urgent first) until one of `depth` places in the ring
/// is free; completions are collected when the device is polled or waited on.
#[cfg(any(target_os = "linux", target_os = "android"))]
struct UringEngine {
    ring: uring::Ring,
    queued: Jobs,
    /// Jobs in the ring, indexed by their `user_data`, with when they were started.
    running: Vec<Option<(Job, Instant)>>,
    /// Per place in `running`: a bounce buffer for unaligned reads (made on first use).
    bounce: Vec<Option<SlotArena>>,
    max_read: usize,
    /// Reads in the ring at once, except demand reads, which may take as many
    /// more.
    depth: usize,
    done: VecDeque<Completion<FileError>>,
    /// Set when the ring failed: every later read fails with this.
    broken: Option<FileError>,
    /// Where the reads the ring held when it failed start (slot, byte): failed
    /// to their caller, but the kernel may still write them, so those slots are
    /// never handed out again from there on ([`FileDevice::kernel_may_write`]).
    held: Vec<(u32, u64)>,
}

#[cfg(any(target_os = "linux", target_os = "android"))]
impl UringEngine {
    fn new(depth: usize, max_read: usize) -> io::Result<UringEngine> {
        let depth = depth.clamp(1, 256);
        Ok(UringEngine {
            ring: uring::Ring::new(2 * depth as u32)?,
            queued: Jobs::default(),
            running: (0..2 * depth).map(|_| None).collect(),
            bounce: (0..2 * depth).map(|_| None).collect(),
            max_read,
            depth,
            done: VecDeque::new(),
            broken: None,
            held: Vec::new(),
        })
    }

    fn is_running(&self) -> bool {
        self.running.iter().any(Option::is_some)
    }

    /// Submits what is queued in the ring, collects what finished (the kernel
    /// posts completions only when asked), blocking for one with `wait`, and
    /// refills the ring.
    fn service(&mut self, s: &Shared, wait: bool) {
        if let Err(e) = self.ring.enter(wait) {
            self.fail_running(s, e);
        }
        self.reap(s);
        self.pump(s);
    }

    /// Starts queued jobs while the ring has room, and submits them.
    fn pump(&mut self, s: &Shared) {
        let mut started = false;
        while let Some(place) = self.running.iter().position(Option::is_none) {
            let busy = self.running.iter().filter(|r| r.is_some()).count();
            let job = if busy < self.depth {
                self.queued.pop()
            } else {
                self.queued.pop_urgent()
            };
            let Some(job) = job else {
                break;
            };
            started = true;
            if let Err((job, e)) = self.start(s, place, job) {
                self.fail(s, job, e, Instant::now());
            }
        }
        if started {
            if let Err(e) = self.ring.enter(false) {
                self.fail_running(s, e);
            }
        }
    }

    /// Puts `job` (its part from `progress` on) into the ring at `place`.
    #[allow(unsafe_code)]
    #[allow(clippy::result_large_err)]
    fn start(&mut self, s: &Shared, place: usize, job: Job) -> Result<(), (Job, FileError)> {
        let req = &job.req;
        let (at, span) = file_span(req);
        let buf = if is_aligned(req) {
            // SAFETY: `job` is in flight: `FileDevice::submit` checked its range is
            // inside the slot and disjoint from every other read in flight, and
            // `FileDevice::slot` / `slot_prefix` hand out no byte of a range a
            // read in flight may write. The kernel writes the range until the
            // completion is taken in `reap`, before the read leaves the
            // in-flight set; if the ring fails first, the range stays out of
            // reach for good (`held`) and the memory is never freed (drop).
            unsafe {
                s.arena
                    .range_mut(req.slot.0 as usize, req.slot_offset as usize, span)
            }
        } else {
            // (One ring read moves at most `u32::MAX` bytes: the widened span of
            // a read near 4 GiB would not fit.)
            if span > self.max_read || span > u32::MAX as usize {
                return Err((
                    job,
                    file_error(io::ErrorKind::InvalidInput, "read larger than a slot"),
                ));
            }
            if self.bounce[place].is_none() {
                self.bounce[place] = SlotArena::new(1, self.max_read);
            }
            let Some(b) = self.bounce[place].as_ref() else {
                return Err((
                    job,
                    file_error(io::ErrorKind::OutOfMemory, "no bounce buffer"),
                ));
            };
            // SAFETY: the bounce buffer of `place` belongs to the job there alone.
            unsafe { b.range_mut(0, 0, span) }
        };
        let p = job.progress as usize;
        let (buf, n, at) = (buf[p..].as_mut_ptr(), (span - p) as u32, at + p as u64);
        // SAFETY: `buf` is valid for `n` bytes and reserved for this job (above)
        // until `reap` takes its completion; the file outlives the engine (the
        // device drains the ring before its `Shared` can go).
        let queued = unsafe {
            self.ring
                .push_read(std::os::fd::AsFd::as_fd(&s.file), buf, n, at, place as u64)
        };
        if !queued {
            return Err((
                job,
                file_error(io::ErrorKind::Other, "io_uring submission ring full"),
            ));
        }
        self.running[place] = Some((
            Job {
                lane: place as u16,
                ..job
            },
            Instant::now(),
        ));
        Ok(())
    }

    /// Takes every posted completion; finished reads go to `done`.
    fn reap(&mut self, s: &Shared) {
        while let Some((user_data, res)) = self.ring.pop() {
            let place = user_data as usize;
            let Some((mut job, started)) = self.running.get_mut(place).and_then(Option::take)
            else {
                continue;
            };
            let req = job.req;
            let (at, want) = file_span(&req);
            if res < 0 {
                let e = io::Error::from_raw_os_error(-res);
                let err = file_error(
                    e.kind(),
                    format!("read of {want} bytes at offset {at} failed: {e}"),
                );
                self.fail(s, job, err, started);
                continue;
            }
            job.progress += res as u32;
            let got = job.progress as usize;
            if res > 0 && got < needed(&req) {
                // A short read of wanted bytes: continue from where it stopped.
                if let Err((job, e)) = self.start(s, place, job) {
                    self.fail(s, job, e, started);
                } else if let Some((_, t)) = self.running[place].as_mut() {
                    *t = started;
                }
                continue;
            }
            let result = if is_aligned(&req) {
                if got < want {
                    Err(file_error(
                        io::ErrorKind::UnexpectedEof,
                        format!("short read at offset {}: {got} of {want} bytes", req.offset),
                    ))
                } else {
                    Ok(want as u64)
                }
            } else {
                self.copy_out(s, place, &req, got)
            };
            match result {
                Ok(file_bytes) => self.finish(s, job, file_bytes, started),
                Err(e) => self.fail(s, job, e, started),
            }
        }
    }

    /// Copies the wanted part of an unaligned read from its bounce buffer into
    /// the slot; the bytes read from the file.
    #[allow(unsafe_code)]
    fn copy_out(
        &self,
        s: &Shared,
        place: usize,
        req: &ReadRequest,
        got: usize,
    ) -> Result<u64, FileError> {
        let span = widened(req).1;
        let (off, len) = (req.slot_offset as usize, req.len as usize);
        let b = self.bounce[place]
            .as_ref()
            .ok_or_else(|| file_error(io::ErrorKind::Other, "no bounce buffer"))?;
        // SAFETY: the read into the bounce buffer completed (its completion was
        // taken), and the buffer belongs to this place alone.
        let src = unsafe { b.range_mut(0, 0, span) };
        // SAFETY: as in `start`: the job is still in flight, so this range of the
        // slot is written by this job alone.
        let dst = unsafe { s.arena.range_mut(req.slot.0 as usize, off, len) };
        unbounce(req, src, got, dst)?;
        Ok(span as u64)
    }

    /// Counts a finished chunk and completes its read if it was the last.
    #[allow(unsafe_code)]
    fn finish(&mut self, s: &Shared, job: Job, file_bytes: u64, started: Instant) {
        let req = job.req;
        let c = &s.counters;
        c.bytes.fetch_add(req.len as u64, Ordering::Relaxed);
        c.file_bytes.fetch_add(file_bytes, Ordering::Relaxed);
        if job.hash_len > 0 {
            // SAFETY: the chunk's read completed and it is still in flight, so no one
            // else writes the range.
            let dst = unsafe {
                s.arena
                    .range_mut(req.slot.0 as usize, req.slot_offset as usize, job.hash_len)
            };
            let crc = les_core::layout::checksum(dst);
            if let Some(slot) = lock(&job.group.crcs).get_mut(job.index) {
                *slot = (crc, job.hash_len as u64);
            }
        }
        self.count_and_complete(s, &job, started);
    }

    fn fail(&mut self, s: &Shared, job: Job, e: FileError, started: Instant) {
        lock(&job.group.error).get_or_insert(e);
        self.count_and_complete(s, &job, started);
    }

    fn count_and_complete(&mut self, s: &Shared, job: &Job, started: Instant) {
        s.counters.reads.fetch_add(1, Ordering::Relaxed);
        s.counters
            .read_nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        s.trace_read(job.lane as usize, &job.req, started);
        s.chunks_ended(1);
        if let Some(c) = job.group.finish(job.req.tag) {
            self.done.push_back(c);
        }
    }

    /// The ring itself failed (never seen on a ring set up right: a kernel or
    /// memory fault). Every queued and running read fails, later reads are
    /// refused, and the kernel may still hold the running ones' buffers (slots
    /// or bounce buffers), so the device leaks its slot memory, this engine's
    /// bounce buffers and the ring rather than free them ([`FileDevice`]'s drop).
    fn fail_running(&mut self, s: &Shared, e: io::Error) {
        let err = file_error(e.kind(), format!("io_uring failed: {e}"));
        self.broken = Some(err.clone());
        let queued: Vec<Job> = self.queued.drain().collect();
        for job in queued {
            self.fail(s, job, err.clone(), Instant::now());
        }
        for place in 0..self.running.len() {
            if let Some((job, started)) = self.running[place].take() {
                self.held.push((job.req.slot.0, job.req.slot_offset as u64));
                self.fail(s, job, err.clone(), started);
            }
        }
    }

    /// Blocks until the kernel holds no read of ours; `false` if the ring failed
    /// (then the memory must not be freed).
    fn drain(&mut self, s: &Shared) -> bool {
        while self.is_running() {
            self.service(s, true);
        }
        self.broken.is_none()
    }
}

/// Whether a read can go straight into its slot with `O_DIRECT`: file offset,
/// slot offset and length all multiples of [`SLOT_ALIGN`].
fn is_aligned(req: &ReadRequest) -> bool {
    let a = SLOT_ALIGN as u64;
    req.offset.is_multiple_of(a)
        && (req.slot_offset as u64).is_multiple_of(a)
        && (req.len as u64).is_multiple_of(a)
}

/// The file range the device reads for `req`: the read itself when aligned, else
/// its [`widened`] span (read into a bounce buffer); its start and length.
fn file_span(req: &ReadRequest) -> (u64, usize) {
    if is_aligned(req) {
        (req.offset, req.len as usize)
    } else {
        widened(req)
    }
}

/// Bytes of [`file_span`] that must arrive: all of an aligned read's; of an
/// unaligned one's widened span, up to the last wanted byte (its last block may
/// pass the end of the file, and asking again past there, at an unaligned
/// offset, is refused by some file systems).
fn needed(req: &ReadRequest) -> usize {
    if is_aligned(req) {
        req.len as usize
    } else {
        (req.offset - widened(req).0) as usize + req.len as usize
    }
}

/// The 4 KiB-aligned file range covering an unaligned read: its start and length.
fn widened(req: &ReadRequest) -> (u64, usize) {
    let a = SLOT_ALIGN as u64;
    let first = req.offset / a * a;
    let end = (req.offset + req.len as u64).div_ceil(a) * a;
    (first, (end - first) as usize)
}

fn read_full(file: &File, dst: &mut [u8], offset: u64) -> Result<(), FileError> {
    file.read_exact_at(dst, offset).map_err(|e| {
        file_error(
            e.kind(),
            format!("read of {} bytes at offset {offset} failed: {e}", dst.len()),
        )
    })
}

/// Performs one read; returns the bytes read from the file and the CRC-32 of the
/// first `hash_len` bytes delivered (0 when `hash_len` is 0).
#[allow(unsafe_code)]
fn read(
    s: &Shared,
    req: &ReadRequest,
    bounce: Option<&SlotArena>,
    hash_len: usize,
) -> Result<(u64, u32), FileError> {
    let (slot, off, len) = (
        req.slot.0 as usize,
        req.slot_offset as usize,
        req.len as usize,
    );
    // SAFETY: `req` is in flight: `FileDevice::submit` checked its range is inside
    // the slot and disjoint from every other read in flight, and
    // `FileDevice::slot` / `slot_prefix` hand out no byte of a range a read in
    // flight may write. The range is written only here, before the completion
    // is published.
    let dst = unsafe { s.arena.range_mut(slot, off, len) };
    let file_bytes = fill(s, req, bounce, dst)?;
    let crc = match dst.get(..hash_len) {
        Some(b) if hash_len > 0 => les_core::layout::checksum(b),
        _ => 0,
    };
    Ok((file_bytes, crc))
}

/// Reads `req` into `dst` (its slot range); returns the bytes read from the file.
#[allow(unsafe_code)]
fn fill(
    s: &Shared,
    req: &ReadRequest,
    bounce: Option<&SlotArena>,
    dst: &mut [u8],
) -> Result<u64, FileError> {
    if !s.direct {
        read_full(&s.file, dst, req.offset)?;
        // Don't let the page cache keep what the slots now hold.
        let _ = rustix::fs::fadvise(
            &s.file,
            req.offset,
            std::num::NonZeroU64::new(req.len as u64),
            rustix::fs::Advice::DontNeed,
        );
        return Ok(req.len as u64);
    }
    if is_aligned(req) {
        read_full(&s.file, dst, req.offset)?;
        return Ok(req.len as u64);
    }
    // Widen to aligned bounds, read into the bounce buffer, copy the part wanted.
    let bounce = bounce.ok_or_else(|| file_error(io::ErrorKind::Other, "no bounce buffer"))?;
    let (first, span) = widened(req);
    if span > bounce.slot_bytes() {
        return Err(file_error(
            io::ErrorKind::InvalidInput,
            "read larger than a slot",
        ));
    }
    // SAFETY: the bounce buffer belongs to this I/O thread alone.
    let buf = unsafe { bounce.range_mut(0, 0, span) };
    // The last block may extend past the end of the file: accept a short read
    // that still covers the wanted bytes.
    let mut got = 0usize;
    while got < needed(req) {
        match s.file.read_at(&mut buf[got..], first + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(file_error(
                    e.kind(),
                    format!("read of {span} bytes at offset {first} failed: {e}"),
                ))
            }
        }
    }
    unbounce(req, buf, got, dst)?;
    Ok(span as u64)
}

/// Copies the bytes an unaligned read wants into `dst`, from its widened span
/// ([`widened`]) read into `buf`, of which `got` bytes arrived (the last block
/// may lie past the end of the file).
fn unbounce(req: &ReadRequest, buf: &[u8], got: usize, dst: &mut [u8]) -> Result<(), FileError> {
    let len = req.len as usize;
    let skip = (req.offset - widened(req).0) as usize;
    if got < skip + len {
        return Err(file_error(
            io::ErrorKind::UnexpectedEof,
            format!(
                "short read at offset {}: {} of {len} bytes",
                req.offset,
                got.saturating_sub(skip)
            ),
        ));
    }
    dst.copy_from_slice(&buf[skip..skip + len]);
    Ok(())
}

impl BlockDevice for FileDevice {
    type Error = FileError;

    fn alignment(&self) -> Alignment {
        // Unaligned reads are accepted (widened internally).
        Alignment {
            io: 1,
            memory: SLOT_ALIGN as u32,
        }
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    fn submit(&mut self, req: ReadRequest) -> Result<(), SubmitError<FileError>> {
        let bad = |m: String| {
            Err(SubmitError::Device(file_error(
                io::ErrorKind::InvalidInput,
                m,
            )))
        };
        let slot_end = req.slot_offset as u64 + req.len as u64;
        if req.slot.0 as usize >= self.shared.arena.n_slots()
            || slot_end > self.shared.arena.slot_len(req.slot.0 as usize) as u64
        {
            return bad(format!("read into slot {} beyond its memory", req.slot.0));
        }
        if req
            .offset
            .checked_add(req.len as u64)
            .is_none_or(|e| e > self.shared.file_len)
        {
            return bad(format!(
                "read of {} bytes at offset {} beyond the end of the file",
                req.len, req.offset
            ));
        }
        let (start, end) = (req.slot_offset as u64, slot_end);
        if self
            .in_flight
            .iter()
            .any(|f| f.tag == req.tag || (f.slot == req.slot.0 && f.start < end && start < f.end))
        {
            return bad(format!(
                "read {:?} overlaps a read in flight into slot {}",
                req.tag, req.slot.0
            ));
        }
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Some(e) = self.uring.as_ref().and_then(|u| u.broken.clone()) {
            return Err(SubmitError::Device(e));
        }
        if self.in_flight.len() >= self.queue_depth {
            return Err(SubmitError::Busy);
        }
        self.in_flight.push(InFlight {
            tag: req.tag,
            slot: req.slot.0,
            start,
            end,
        });
        // Chunks only for aligned reads: an unaligned one would widen every chunk.
        let chunk = match self.chunk_bytes {
            c if c > 0 && self.shared.direct && is_aligned(&req) => c,
            _ => req.len.max(1) as usize,
        };
        let n = (req.len as usize).div_ceil(chunk).max(1);
        let check = self
            .checks
            .at(req.offset)
            .map(|c| Check {
                len: c.len.min(req.len),
                ..c
            })
            .filter(|c| c.len > 0);
        let group = Arc::new(Group {
            remaining: AtomicU64::new(n as u64),
            dropped: AtomicBool::new(false),
            error: Mutex::new(None),
            check: check.map(|c| (c, req.offset)),
            crcs: Mutex::new(if check.is_some() {
                vec![(0, 0); n]
            } else {
                Vec::new()
            }),
        });
        let checked = check.map_or(0, |c| c.len);
        self.shared.chunks_started(n as u64);
        let jobs = (0..n).map(|i| {
            let skip = (i * chunk) as u32;
            let len = (req.len - skip).min(chunk as u32);
            Job {
                req: ReadRequest {
                    offset: req.offset + skip as u64,
                    len,
                    slot_offset: req.slot_offset + skip,
                    ..req
                },
                group: Arc::clone(&group),
                index: i,
                hash_len: checked.saturating_sub(skip).min(len) as usize,
                progress: 0,
                lane: 0,
            }
        });
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Some(u) = self.uring.as_mut() {
            u.queued.push(req.urgent, jobs);
            u.pump(&self.shared);
            return Ok(());
        }
        lock(&self.shared.queue).jobs.push(req.urgent, jobs);
        if n == 1 {
            self.shared.work.notify_one();
        } else {
            self.shared.work.notify_all();
        }
        Ok(())
    }

    fn poll(&mut self) -> Option<Completion<FileError>> {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let c = match self.uring.as_mut() {
            Some(u) => {
                if u.done.is_empty() && u.is_running() {
                    u.service(&self.shared, false);
                }
                u.done.pop_front()?
            }
            None => lock(&self.shared.done).pop_front()?,
        };
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        let c = lock(&self.shared.done).pop_front()?;
        if let Some(i) = self.in_flight.iter().position(|f| f.tag == c.tag) {
            self.in_flight.swap_remove(i);
        }
        Some(c)
    }

    fn wait(&mut self) {
        let start = Instant::now();
        if !self.wait_on_ring() {
            let mut done = lock(&self.shared.done);
            while done.is_empty() && !self.in_flight.is_empty() {
                done = self
                    .shared
                    .done_cv
                    .wait(done)
                    .unwrap_or_else(|p| p.into_inner());
            }
        }
        if let Some(t) = self.shared.trace.get() {
            t.span(What::Stall, start, Instant::now());
        }
        let waited = start.elapsed().as_nanos() as u64;
        self.shared
            .counters
            .stall_nanos
            .fetch_add(waited, Ordering::Relaxed);
    }

    fn cancel(&mut self, tag: Tag) {
        // Chunks not yet started are dropped, and then the read completes as
        // cancelled (once its running chunks finished); a read whose chunks all
        // started completes normally.
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Some(u) = self.uring.as_mut() {
            let groups = u.queued.take(tag);
            self.shared.chunks_ended(groups.len() as u64);
            u.done.extend(cancelled(groups, tag));
            return;
        }
        let groups = lock(&self.shared.queue).jobs.take(tag);
        self.shared.chunks_ended(groups.len() as u64);
        for c in cancelled(groups, tag) {
            lock(&self.shared.done).push_back(c);
            self.shared.done_cv.notify_all();
        }
    }
}

/// Marks dropped chunks finished; the read's completion (cancelled) if that
/// finished it.
fn cancelled(groups: Vec<Arc<Group>>, tag: Tag) -> impl Iterator<Item = Completion<FileError>> {
    groups.into_iter().filter_map(move |g| {
        g.dropped.store(true, Ordering::Release);
        g.finish(tag)
    })
}

#[allow(unsafe_code)]
impl SlotMemory for FileDevice {
    fn slot(&self, slot: SlotId) -> &[u8] {
        assert!(
            !self.in_flight.iter().any(|f| f.slot == slot.0),
            "slot {} read while a read into it is in flight",
            slot.0
        );
        assert!(
            !self.kernel_may_write(slot.0, u64::MAX),
            "slot {} read while the failed io_uring may still write it",
            slot.0
        );
        // SAFETY: no read into this slot is in flight, nor held by a failed ring
        // (checked above), so neither an I/O thread nor the kernel writes it; a
        // new read can only start through `submit(&mut self)`, which the
        // returned borrow of `self` prevents while the slice lives.
        unsafe { self.shared.arena.slot(slot.0 as usize) }
    }

    fn slot_prefix(&self, slot: SlotId, len: usize) -> &[u8] {
        assert!(
            !self
                .in_flight
                .iter()
                .any(|f| f.slot == slot.0 && f.start < len as u64),
            "slot {} read over {len} bytes while a read into them is in flight",
            slot.0
        );
        assert!(
            !self.kernel_may_write(slot.0, len as u64),
            "slot {} read over {len} bytes while the failed io_uring may still write them",
            slot.0
        );
        // SAFETY: no read in flight, nor held by a failed ring, writes the
        // slot's first `len` bytes (checked above: each writes only
        // `start..end` of its slot); a new read can only start through
        // `submit(&mut self)`, which the returned borrow of `self` prevents
        // while the slice lives.
        unsafe { self.shared.arena.prefix(slot.0 as usize, len) }
    }
}

fn too_many() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        "slot count or size beyond 32 bits",
    )
}

impl Drop for FileDevice {
    fn drop(&mut self) {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Some(u) = self.uring.as_mut() {
            u.queued.clear();
            if !u.drain(&self.shared) {
                // The kernel may still write what the failed ring's reads
                // target, the slots or the engine's bounce buffers, and closing
                // the ring does not wait for it: leak all of them (and the ring).
                std::mem::forget(Arc::clone(&self.shared));
                std::mem::forget(self.uring.take());
            }
        }
        {
            let mut q = lock(&self.shared.queue);
            q.jobs.clear();
            q.shutdown = true;
        }
        self.shared.work.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `io_uring` device of two 64 KiB slots over a 1 MiB file (removed at
    /// once), on the repository's disk, which takes O_DIRECT (a tmpfs would not).
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn uring_device(name: &str) -> FileDevice {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("flash-{name}-{}.bin", std::process::id()));
        std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        let cfg = FileDeviceConfig {
            engine: IoEngine::Uring,
            threads: 2,
            queue_depth: 4,
            direct: true,
            chunk_bytes: 0,
        };
        let dev = FileDevice::open(&path, 2, 64 << 10, cfg);
        std::fs::remove_file(&path).unwrap();
        dev.unwrap()
    }

    /// A ring that fails with reads in it fails those reads to their caller,
    /// but the kernel may still write their slots: those stay out of reach.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[test]
    fn slots_a_failed_ring_held_are_never_handed_out() {
        let mut dev = uring_device("held");
        let read = |tag, slot| ReadRequest {
            tag: Tag(tag),
            offset: 0,
            len: 64 << 10,
            slot: SlotId(slot),
            slot_offset: 0,
            urgent: true,
        };
        dev.submit(read(1, 0)).unwrap();
        // The ring fails with the read in it, as a kernel fault would make it.
        let u = dev.uring.as_mut().unwrap();
        assert!(u.is_running());
        u.fail_running(&dev.shared, io::Error::other("injected"));
        let c = dev.poll().expect("the read completes, failed");
        assert!(matches!(c.status, ReadStatus::Failed(_)), "{c:?}");
        assert!(dev.in_flight.is_empty());
        assert_eq!(dev.slot(SlotId(1)).len(), 64 << 10, "no read was there");
        let panics = |f: &dyn Fn(&FileDevice) -> usize| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&dev))).is_err()
        };
        assert!(panics(&|d| d.slot(SlotId(0)).len()));
        assert!(panics(&|d| d.slot_prefix(SlotId(0), 4096).len()));
        assert!(
            dev.submit(read(2, 1)).is_err(),
            "a failed ring takes no reads"
        );
    }

    /// After a ring failure the memory the kernel may still write stays mapped
    /// when the device is dropped: the slots and, for an unaligned read, the
    /// bounce buffer it went to (which was unmapped).
    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[test]
    fn a_failed_rings_buffers_outlive_the_device() {
        let mut dev = uring_device("bounce");
        // Unaligned: read through a bounce buffer.
        dev.submit(ReadRequest {
            tag: Tag(1),
            offset: 100,
            len: 1000,
            slot: SlotId(0),
            slot_offset: 0,
            urgent: true,
        })
        .unwrap();
        let u = dev.uring.as_mut().unwrap();
        let bounce: Vec<usize> = u.bounce.iter().flatten().map(SlotArena::address).collect();
        assert_eq!(bounce.len(), 1, "the read went through a bounce buffer");
        let slots = dev.shared.arena.address();
        u.fail_running(&dev.shared, io::Error::other("injected"));
        drop(dev);
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let mapped = |addr: usize| {
            maps.lines().any(|l| {
                let range = l.split_whitespace().next().unwrap();
                let (a, b) = range.split_once('-').unwrap();
                let (a, b) = (
                    usize::from_str_radix(a, 16).unwrap(),
                    usize::from_str_radix(b, 16).unwrap(),
                );
                (a..b).contains(&addr)
            })
        };
        assert!(mapped(slots), "the slots were unmapped");
        assert!(mapped(bounce[0]), "the bounce buffer was unmapped");
    }

    #[test]
    fn auto_engine_keeps_io_uring_for_experts_of_one_read_only() {
        let auto = |chunk_bytes| FileDeviceConfig {
            engine: IoEngine::Auto,
            chunk_bytes,
            ..FileDeviceConfig::default()
        };
        let engine = |c: FileDeviceConfig, largest| c.for_reads(largest).engine;
        assert_eq!(engine(auto(512 << 10), 442 << 10), IoEngine::Auto);
        assert_eq!(engine(auto(512 << 10), 512 << 10), IoEngine::Auto);
        assert_eq!(engine(auto(512 << 10), (512 << 10) + 1), IoEngine::Threads);
        assert_eq!(engine(auto(1 << 20), 900 << 10), IoEngine::Auto);
        // Unsplit reads: the default chunk size is the bound.
        assert_eq!(engine(auto(0), 442 << 10), IoEngine::Auto);
        assert_eq!(engine(auto(0), 3 << 20), IoEngine::Threads);
        // Asked for by name: kept.
        for e in [IoEngine::Uring, IoEngine::Threads] {
            let c = FileDeviceConfig {
                engine: e,
                ..auto(512 << 10)
            };
            assert_eq!(engine(c, 3 << 20), e);
            assert_eq!(engine(c, 4096), e);
        }
    }

    #[test]
    fn read_checks_match_exact_offsets_and_keep_the_last_of_a_repeat() {
        let c = |crc| Check { len: 8, crc };
        let checks = ReadChecks::new(vec![(8192, c(1)), (0, c(2)), (8192, c(3))]);
        assert_eq!(checks.len(), 2);
        assert_eq!(checks.at(0), Some(c(2)));
        assert_eq!(checks.at(8192), Some(c(3)));
        assert_eq!(checks.at(4096), None);
        assert!(ReadChecks::default().is_empty());
    }
}
