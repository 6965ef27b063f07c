//! The file device against a real file: O_DIRECT and buffered, aligned and
//! unaligned reads, urgent-first service, cancellation, and the scheduler streaming
//! through it with the slot bytes checked against the file.

use std::path::PathBuf;

use les::flash::{Check, FileDevice, FileDeviceConfig, IoEngine, ReadChecks};
use les_core::blockdev::{
    BlockDevice, ReadRequest, ReadStatus, SlotId, SlotMemory, SubmitError, Tag,
};
use les_core::schedule::{
    ExpertSource, Extent, Extents, LayerState, Next, Scheduler, SchedulerConfig,
};
use les_core::slots::{ExpertKey, IndexEntry, Slot};

fn data_file(name: &str, len: usize) -> (PathBuf, Vec<u8>) {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let mut x = 0x1234_5678u32;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

fn req(tag: u32, offset: u64, len: u32, slot: u32, slot_offset: u32, urgent: bool) -> ReadRequest {
    ReadRequest {
        tag: Tag(tag),
        offset,
        len,
        slot: SlotId(slot),
        slot_offset,
        urgent,
    }
}

/// A device of 4 slots of 64 KiB over `path`, 3 I/O threads, 8 reads in flight.
/// Both ways of issuing reads: every test runs against each.
const ENGINES: [IoEngine; 2] = [IoEngine::Threads, IoEngine::Uring];

/// `engine` for an `O_DIRECT` device; a buffered one always uses threads (`Auto`
/// falls back to them, as `io_uring` needs `O_DIRECT`).
fn four_slots(
    path: &std::path::Path,
    direct: bool,
    chunk_bytes: usize,
    engine: IoEngine,
) -> FileDevice {
    let cfg = FileDeviceConfig {
        engine: if direct { engine } else { IoEngine::Auto },
        threads: 3,
        queue_depth: 8,
        direct,
        chunk_bytes,
    };
    FileDevice::open(path, 4, 64 * 1024, cfg).unwrap()
}

/// A direct device of 2 slots of 256 KiB over `path`, 2 I/O threads (or ring
/// places), 4 reads in flight, reads split into 4 KiB chunks.
fn two_chunked_slots(path: &std::path::Path, engine: IoEngine) -> FileDevice {
    let cfg = FileDeviceConfig {
        engine,
        threads: 2,
        queue_depth: 4,
        direct: true,
        chunk_bytes: 4096,
    };
    FileDevice::open(path, 2, 256 * 1024, cfg).unwrap()
}

fn drain(dev: &mut FileDevice, n: usize) -> Vec<(Tag, ReadStatus<les::flash::FileError>)> {
    let mut out = Vec::new();
    while out.len() < n {
        match dev.poll() {
            Some(c) => out.push((c.tag, c.status)),
            None => dev.wait(),
        }
    }
    out
}

#[test]
fn aligned_and_unaligned_reads_land_in_slots() {
    let (path, data) = data_file("flash_a.bin", 1 << 20);
    for (direct, chunk_bytes, engine) in [(true, 0), (true, 4096), (true, 20_000), (false, 4096)]
        .into_iter()
        .flat_map(|(d, c)| ENGINES.map(|e| (d, c, e)))
    {
        let mut dev = four_slots(&path, direct, chunk_bytes, engine);
        assert_eq!(dev.uses_uring(), direct && engine == IoEngine::Uring);
        let reads = [
            req(1, 0, 65536, 0, 0, true),                // aligned
            req(2, 12345, 1000, 1, 0, false),            // unaligned offset and length
            req(3, 4096 * 7 + 1, 4095, 1, 4096, true),   // second part of slot 1
            req(4, (1 << 20) - 777, 777, 2, 100, false), // ends at EOF
        ];
        for r in reads {
            dev.submit(r).unwrap();
        }
        for (_, st) in drain(&mut dev, 4) {
            assert_eq!(st, ReadStatus::Done);
        }
        for r in reads {
            let got = &dev.slot(r.slot)[r.slot_offset as usize..][..r.len as usize];
            assert_eq!(
                got,
                &data[r.offset as usize..][..r.len as usize],
                "read {:?} direct={direct} chunk_bytes={chunk_bytes} {engine:?}",
                r.tag
            );
        }
    }
}

#[test]
fn reads_are_checked_on_the_io_threads_across_chunks() {
    let (path, data) = data_file("flash_checks.bin", 1 << 20);
    let crc = |off: usize, len: usize| les_core::layout::checksum(&data[off..off + len]);
    // The checked prefix ends inside a chunk (20 000 bytes of 4 KiB chunks), or
    // covers the whole read; one check is wrong; one read has none.
    let checks = ReadChecks::new(vec![
        (
            0,
            Check {
                len: 20_000,
                crc: crc(0, 20_000),
            },
        ),
        (
            65536,
            Check {
                len: 65536,
                crc: crc(65536, 65536),
            },
        ),
        (
            4096 * 40,
            Check {
                len: 12_288,
                crc: crc(4096 * 40, 12_288) ^ 1,
            },
        ),
    ]);
    assert_eq!(checks.len(), 3);
    for (direct, chunk_bytes, engine) in [(true, 4096), (true, 0), (false, 4096)]
        .into_iter()
        .flat_map(|(d, c)| ENGINES.map(|e| (d, c, e)))
    {
        let mut dev = four_slots(&path, direct, chunk_bytes, engine);
        dev.set_checks(checks.clone());
        let reads = [
            req(1, 0, 65536, 0, 0, true),
            req(2, 65536, 65536, 1, 0, false),
            req(3, 4096 * 40, 16384, 2, 0, true),
            req(4, 4096 * 80, 8192, 3, 0, false),
        ];
        for r in reads {
            dev.submit(r).unwrap();
        }
        let mut got = drain(&mut dev, 4);
        got.sort_by_key(|(t, _)| t.0);
        let what = format!("direct={direct} chunk_bytes={chunk_bytes} {engine:?}");
        assert_eq!(got[0].1, ReadStatus::Done, "{what}");
        assert_eq!(got[1].1, ReadStatus::Done, "{what}");
        assert_eq!(got[3].1, ReadStatus::Done, "unchecked read, {what}");
        match &got[2].1 {
            ReadStatus::Failed(e) => {
                assert_eq!(e.kind, std::io::ErrorKind::InvalidData, "{what}");
                assert!(e.message.contains("checksum mismatch"), "{e}");
                assert!(!les_core::blockdev::DeviceError::is_transient(e));
            }
            other => panic!("a wrong checksum must fail the read, {what}: {other:?}"),
        }
    }
}

#[test]
fn rejects_bad_and_overlapping_requests() {
    let (path, _) = data_file("flash_b.bin", 1 << 16);
    for engine in ENGINES {
        rejects_bad_and_overlapping(&path, engine);
    }
}

fn rejects_bad_and_overlapping(path: &std::path::Path, engine: IoEngine) {
    let mut dev = FileDevice::open(
        path,
        2,
        4096,
        FileDeviceConfig {
            engine,
            threads: 1,
            queue_depth: 2,
            direct: true,
            chunk_bytes: 0,
        },
    )
    .unwrap();
    assert!(
        matches!(
            dev.submit(req(1, 0, 8192, 0, 0, true)),
            Err(SubmitError::Device(_))
        ),
        "beyond slot"
    );
    assert!(
        matches!(
            dev.submit(req(1, 65000, 1000, 0, 0, true)),
            Err(SubmitError::Device(_))
        ),
        "beyond file"
    );
    assert!(
        matches!(
            dev.submit(req(1, 0, 10, 5, 0, true)),
            Err(SubmitError::Device(_))
        ),
        "no such slot"
    );
    dev.submit(req(1, 0, 100, 0, 0, true)).unwrap();
    assert!(
        matches!(
            dev.submit(req(2, 0, 100, 0, 50, true)),
            Err(SubmitError::Device(_))
        ),
        "overlap"
    );
    dev.submit(req(3, 0, 100, 1, 0, true)).unwrap();
    assert_eq!(
        dev.submit(req(4, 0, 100, 0, 200, true)),
        Err(SubmitError::Busy)
    );
    drain(&mut dev, 2);
}

#[test]
#[should_panic(expected = "in flight")]
fn slot_with_read_in_flight_cannot_be_read() {
    let (path, _) = data_file("flash_c.bin", 1 << 16);
    let mut dev = FileDevice::open(&path, 1, 4096, FileDeviceConfig::default()).unwrap();
    dev.submit(req(1, 0, 4096, 0, 0, true)).unwrap();
    let _ = dev.slot(SlotId(0));
}

#[test]
#[should_panic(expected = "in flight")]
fn slot_with_read_in_flight_cannot_be_read_with_io_uring() {
    let (path, _) = data_file("flash_c2.bin", 1 << 16);
    let cfg = FileDeviceConfig {
        engine: IoEngine::Uring,
        ..FileDeviceConfig::default()
    };
    let mut dev = FileDevice::open(&path, 1, 4096, cfg).unwrap();
    dev.submit(req(1, 0, 4096, 0, 0, true)).unwrap();
    // Even once the kernel has finished the read, it is in flight until polled.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let _ = dev.slot(SlotId(0));
}

#[test]
fn io_uring_needs_direct_reads_and_auto_falls_back_to_threads() {
    let (path, data) = data_file("flash_f.bin", 1 << 16);
    let buffered = |engine| FileDeviceConfig {
        engine,
        direct: false,
        ..FileDeviceConfig::default()
    };
    let err = FileDevice::open(&path, 1, 4096, buffered(IoEngine::Uring)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::Unsupported, "{err}");
    assert!(err.to_string().contains("O_DIRECT"), "{err}");
    let mut dev = FileDevice::open(&path, 1, 4096, buffered(IoEngine::Auto)).unwrap();
    assert!(!dev.uses_uring() && !dev.is_direct());
    dev.submit(req(1, 100, 1000, 0, 0, true)).unwrap();
    assert_eq!(drain(&mut dev, 1)[0].1, ReadStatus::Done);
    assert_eq!(&dev.slot(SlotId(0))[..1000], &data[100..1100]);
    let direct = FileDeviceConfig {
        engine: IoEngine::Auto,
        ..FileDeviceConfig::default()
    };
    assert!(FileDevice::open(&path, 1, 4096, direct)
        .unwrap()
        .uses_uring());
}

#[test]
fn cancelling_a_chunked_read_completes_it_once() {
    let (path, data) = data_file("flash_e.bin", 1 << 20);
    for (round, engine) in (0..20u32).flat_map(|r| ENGINES.map(|e| (r, e))) {
        let mut dev = two_chunked_slots(&path, engine);
        // 64 chunks each; cancel the second read at a different moment each round.
        dev.submit(req(1, 0, 256 * 1024, 0, 0, false)).unwrap();
        dev.submit(req(2, 512 * 1024, 256 * 1024, 1, 0, false))
            .unwrap();
        for _ in 0..round * 10 {
            std::hint::spin_loop();
        }
        dev.cancel(Tag(2));
        let done = drain(&mut dev, 2);
        assert_eq!(done.iter().filter(|(t, _)| *t == Tag(2)).count(), 1);
        for (tag, st) in done {
            if tag == Tag(1) || st == ReadStatus::Done {
                let r = if tag == Tag(1) { 0 } else { 512 * 1024 };
                let slot = if tag == Tag(1) { 0 } else { 1 };
                assert_eq!(st, ReadStatus::Done);
                assert_eq!(dev.slot(SlotId(slot)), &data[r..r + 256 * 1024]);
            } else {
                assert_eq!(st, ReadStatus::Cancelled);
            }
        }
        assert!(dev.poll().is_none(), "exactly one completion per read");
        // The slot is usable again.
        dev.submit(req(3, 4096, 8192, 1, 0, true)).unwrap();
        drain(&mut dev, 1);
        assert_eq!(&dev.slot(SlotId(1))[..8192], &data[4096..4096 + 8192]);
    }
}

/// The busy clock runs while chunks are outstanding, however they end (read or
/// dropped by a cancel), and stops when none are.
#[test]
fn busy_time_covers_outstanding_reads_only() {
    let (path, _) = data_file("flash_busy.bin", 1 << 20);
    for engine in ENGINES {
        let mut dev = two_chunked_slots(&path, engine);
        let busy = |d: &FileDevice| d.counters().snapshot().busy_nanos;
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(busy(&dev), 0, "{engine:?}: idle since opened");
        let t0 = std::time::Instant::now();
        dev.submit(req(1, 0, 256 * 1024, 0, 0, false)).unwrap();
        dev.submit(req(2, 512 * 1024, 256 * 1024, 1, 0, false))
            .unwrap();
        dev.cancel(Tag(2));
        drain(&mut dev, 2);
        let wall = t0.elapsed().as_nanos() as u64;
        let b = busy(&dev);
        assert!(b > 0 && b <= wall, "{engine:?}: busy {b} ns of {wall}");
        // Nothing outstanding: idle time is not counted.
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(busy(&dev), b, "{engine:?}: the clock stopped");
        let t1 = std::time::Instant::now();
        dev.submit(req(3, 4096, 8192, 1, 0, true)).unwrap();
        drain(&mut dev, 1);
        let more = busy(&dev) - b;
        assert!(
            more > 0 && more <= t1.elapsed().as_nanos() as u64,
            "{engine:?}: a later read counts only its own time ({more} ns)"
        );
    }
}

#[test]
fn io_snapshot_counts_the_busy_time_of_reads_still_outstanding() {
    let (path, _) = data_file("flash_busy_open.bin", 1 << 20);
    for engine in ENGINES {
        let mut dev = two_chunked_slots(&path, engine);
        let t0 = std::time::Instant::now();
        dev.submit(req(1, 0, 256 * 1024, 0, 0, false)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
        let open = dev.io_snapshot().busy_nanos;
        if dev.uses_uring() {
            // Nothing polled the ring: the read is outstanding, its stretch open,
            // and the counters alone would say 0.
            assert_eq!(dev.counters().snapshot().busy_nanos, 0, "{engine:?}");
            assert!(open >= 10_000_000, "{engine:?}: {open} ns so far");
        }
        drain(&mut dev, 1);
        let closed = dev.io_snapshot().busy_nanos;
        let wall = t0.elapsed().as_nanos() as u64;
        assert!(
            0 < open && open <= closed && closed <= wall,
            "{engine:?}: {open} then {closed} ns of {wall}"
        );
        assert_eq!(closed, dev.counters().snapshot().busy_nanos, "{engine:?}");
    }
}

struct Experts {
    n_experts: u16,
    size: u32,
    stride: u64,
    /// One 4 KiB-aligned extent per expert (a packed file) instead of three
    /// unaligned ones (a plain GGUF).
    aligned: bool,
}

impl ExpertSource for Experts {
    fn extents(&self, key: ExpertKey) -> Extents {
        let i = key.layer as u64 * self.n_experts as u64 + key.expert as u64;
        if self.aligned {
            let mut e = Extents::new();
            e.push(Extent {
                offset: i * self.stride,
                len: self.size,
                slot_offset: 0,
            })
            .unwrap();
            return e;
        }
        // Three unaligned parts per expert, as in a plain GGUF.
        let base = 777 + i * self.stride;
        let third = self.size / 3;
        let mut e = Extents::new();
        for p in 0..3u32 {
            e.push(Extent {
                offset: base + (p * third) as u64 * 2,
                len: third,
                slot_offset: p * third,
            })
            .unwrap();
        }
        e
    }
}

#[test]
fn scheduler_streams_through_the_file_device() {
    let (path, data) = data_file("flash_d.bin", 4 << 20);
    for (aligned, engine) in [false, true]
        .into_iter()
        .flat_map(|a| ENGINES.map(|e| (a, e)))
    {
        let src = Experts {
            n_experts: 16,
            size: if aligned { 40_960 } else { 30_000 },
            stride: if aligned { 69_632 } else { 70_001 },
            aligned,
        };
        let cfg = FileDeviceConfig {
            engine,
            chunk_bytes: 8192,
            ..FileDeviceConfig::default()
        };
        stream(&path, &data, &src, cfg);
    }
}

fn stream(path: &std::path::Path, data: &[u8], src: &Experts, cfg: FileDeviceConfig) {
    let mut dev = FileDevice::open(path, 5, src.size as usize, cfg).unwrap();
    let mut sched = Scheduler::new(
        SchedulerConfig::les(),
        vec![Slot::EMPTY; 5],
        vec![IndexEntry::EMPTY; 3 * 16],
        vec![LayerState::INITIAL; 3],
        3,
        16,
        src.size,
    )
    .unwrap();
    let mut x = 7u32;
    let mut rnd = || {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        (x >> 16) as u16 % 16
    };
    for _token in 0..20 {
        sched.begin_token();
        for layer in 0..3u16 {
            let mut picks = Vec::new();
            while picks.len() < 3 {
                let e = rnd();
                if !picks.contains(&e) {
                    picks.push(e);
                }
            }
            sched.begin_layer(layer, &picks, &mut dev, src).unwrap();
            let pred: Vec<u16> = (0..3).map(|_| rnd()).collect();
            sched
                .prefetch((layer + 1) % 3, &pred, &mut dev, src)
                .unwrap();
            loop {
                match sched.next_blocking(&mut dev, src).unwrap() {
                    Next::Compute {
                        index, key, slot, ..
                    } => {
                        let bytes = dev.slot(slot);
                        for e in src.extents(key) {
                            assert_eq!(
                                &bytes[e.slot_offset as usize..][..e.len as usize],
                                &data[e.offset as usize..][..e.len as usize],
                                "{key}"
                            );
                        }
                        sched.finish::<()>(index).unwrap();
                    }
                    Next::Done => break,
                    Next::Wait => unreachable!("next_blocking waits"),
                    Next::ComputeFirst { .. } | Next::ComputeRest { .. } => {
                        unreachable!("next_blocking hands out whole experts")
                    }
                }
            }
        }
    }
    let st = sched.stats();
    assert!(st.misses > 0 && st.demand_bytes > 0, "{st:?}");
}
