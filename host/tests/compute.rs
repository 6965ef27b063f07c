//! `ThreadedMatVec` against `SerialMatVec`, and the `Pool` protocol.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use les::compute::{Pool, ThreadedMatVec};
use les_core::gemv::{GemvError, Isa, MatrixView};
use les_core::model::forward::{MatVec, SerialMatVec};
use les_core::quant::blocks::{BlockQ8K, BlockQ8_0, BlockQ8_1};
use les_core::quant::{quantize, GgmlType, QK_K};

fn noise(state: &mut u64) -> f32 {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut st = seed;
    let vals: Vec<f32> = (0..rows * cols).map(|_| noise(&mut st)).collect();
    let mut data = vec![0u8; ty.row_bytes(cols).unwrap() * rows];
    quantize(ty, &vals, &mut data).unwrap();
    data
}

fn vector(n: usize, seed: u64) -> Vec<f32> {
    let mut st = seed;
    (0..n).map(|_| noise(&mut st) * 3.0).collect()
}

fn serial(isa: Isa, w: &MatrixView<'_>, x: &[f32], y: &mut [f32]) -> Result<(), GemvError> {
    let z0 = BlockQ8_0 {
        d: [0; 2],
        qs: [0; 32],
    };
    let z1 = BlockQ8_1 {
        d: [0; 2],
        s: [0; 2],
        qs: [0; 32],
    };
    let zk = BlockQ8K {
        d: [0; 4],
        qs: [0; QK_K],
        bsums: [[0; 2]; QK_K / 16],
    };
    let n = x.len() / 32 + 1;
    let (mut a, mut b, mut c) = (vec![z0; n], vec![z1; n], vec![zk; n]);
    SerialMatVec {
        isa,
        q8_0: &mut a,
        q8_1: &mut b,
        q8k: &mut c,
    }
    .matvec(w, x, y)
}

const TYPES: [GgmlType; 10] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q6K,
];

#[test]
fn compute_threaded_is_bit_identical_to_serial() {
    let cols = 512;
    let mut pools: Vec<ThreadedMatVec> = [1, 2, 3, 4, 7]
        .iter()
        .map(|&t| ThreadedMatVec::new(t, Isa::detect()))
        .collect();
    for (k, ty) in TYPES.into_iter().enumerate() {
        for rows in [1, 63, 64, 65, 700, 1037] {
            let data = matrix(ty, rows, cols, 17 + k as u64);
            let w = MatrixView::new(ty, rows, cols, &data).unwrap();
            let x = vector(cols, 99 + rows as u64);
            let mut want = vec![0f32; rows];
            serial(Isa::detect(), &w, &x, &mut want).unwrap();
            for mv in &mut pools {
                // Every start offset within a cache line of the output.
                for offset in [0, 1, 5, 15] {
                    let mut buf = vec![f32::NAN; rows + offset];
                    mv.matvec(&w, &x, &mut buf[offset..]).unwrap();
                    for (i, (a, b)) in buf[offset..].iter().zip(&want).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{ty:?} {rows} rows, {} threads, row {i}",
                            mv.threads()
                        );
                    }
                }
            }
        }
    }
}

/// `matmul` of several inputs gives each input's `matvec`, bit for bit, over
/// any thread count, for matrices of one `gemm` tile and of many; a mismatched
/// output is an error that writes nothing.
#[test]
fn compute_matmul_is_matvec_of_each_input() {
    let cols = 512;
    let mut pools: Vec<ThreadedMatVec> = [1, 2, 3]
        .iter()
        .map(|&t| ThreadedMatVec::new(t, Isa::detect()))
        .collect();
    for (k, ty) in TYPES.into_iter().enumerate() {
        for rows in [1, 65, 1037] {
            let data = matrix(ty, rows, cols, 31 + k as u64);
            let w = MatrixView::new(ty, rows, cols, &data).unwrap();
            for n in [1, 2, 5] {
                let xs = vector(n * cols, 7 + (rows * n) as u64);
                let mut want = vec![0f32; n * rows];
                for (x, y) in xs.chunks(cols).zip(want.chunks_mut(rows)) {
                    serial(Isa::detect(), &w, x, y).unwrap();
                }
                for mv in &mut pools {
                    let mut got = vec![f32::NAN; n * rows];
                    mv.matmul(&w, &xs, &mut got).unwrap();
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{ty:?} {rows} rows, {n} inputs, {} threads, element {i}",
                            mv.threads()
                        );
                    }
                    let mut short = vec![f32::NAN; n * rows - 1];
                    assert!(mv.matmul(&w, &xs, &mut short).is_err());
                    assert!(short.iter().all(|v| v.is_nan()));
                }
            }
        }
    }
}

#[test]
fn compute_checksum_is_the_whole_matrix_crc_and_the_product_unchanged() {
    // Large enough to be split over the threads, so each part is hashed by the
    // thread that computed it and the parts' CRCs are combined.
    let mut pools: Vec<ThreadedMatVec> = [1, 2, 3, 4]
        .iter()
        .map(|&t| ThreadedMatVec::new(t, Isa::detect()))
        .collect();
    for (ty, rows, cols) in [
        (GgmlType::Q4K, 768, 2048),
        (GgmlType::Q8_0, 1037, 512),
        (GgmlType::Q6K, 64, 4096),
        (GgmlType::F32, 300, 256),
        (GgmlType::Q4_0, 7, 64),
    ] {
        let data = matrix(ty, rows, cols, rows as u64);
        let w = MatrixView::new(ty, rows, cols, &data).unwrap();
        let x = vector(cols, 5);
        let mut want = vec![0f32; rows];
        serial(Isa::detect(), &w, &x, &mut want).unwrap();
        for mv in &mut pools {
            let mut y = vec![f32::NAN; rows];
            let crc = mv.matvec_checksum(&w, &x, &mut y).unwrap();
            let what = format!("{ty:?} {rows}x{cols}, {} threads", mv.threads());
            assert_eq!(crc, les_core::layout::checksum(&data), "{what}");
            assert!(
                y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}"
            );
        }
        // One flipped bit anywhere changes the checksum (the product may differ).
        for at in [0, data.len() / 2, data.len() - 1] {
            let mut bad = data.clone();
            bad[at] ^= 0x10;
            let w = MatrixView::new(ty, rows, cols, &bad).unwrap();
            let mut y = vec![0f32; rows];
            let crc = pools[1].matvec_checksum(&w, &x, &mut y).unwrap();
            assert_ne!(
                crc,
                les_core::layout::checksum(&data),
                "{ty:?} flip at {at}"
            );
        }
    }
}

#[test]
fn compute_scalar_isa_matches_too() {
    let (ty, rows, cols) = (GgmlType::Q4K, 300, 1024);
    let data = matrix(ty, rows, cols, 5);
    let w = MatrixView::new(ty, rows, cols, &data).unwrap();
    let x = vector(cols, 6);
    let mut want = vec![0f32; rows];
    serial(Isa::Scalar, &w, &x, &mut want).unwrap();
    let mut got = vec![0f32; rows];
    ThreadedMatVec::new(3, Isa::Scalar)
        .matvec(&w, &x, &mut got)
        .unwrap();
    assert_eq!(
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn compute_scratch_grows_across_row_lengths() {
    let mut mv = ThreadedMatVec::new(2, Isa::detect());
    for (ty, cols) in [
        (GgmlType::Q4K, 256),
        (GgmlType::Q4K, 2048),
        (GgmlType::Q4_1, 64),
        (GgmlType::Q8_0, 1024),
        (GgmlType::Q4K, 512),
        (GgmlType::Q6K, 4096),
    ] {
        let rows = 300;
        let data = matrix(ty, rows, cols, cols as u64);
        let w = MatrixView::new(ty, rows, cols, &data).unwrap();
        let x = vector(cols, 3);
        let mut want = vec![0f32; rows];
        serial(Isa::detect(), &w, &x, &mut want).unwrap();
        let mut got = vec![0f32; rows];
        mv.matvec(&w, &x, &mut got).unwrap();
        assert_eq!(want, got, "{ty:?} x {cols}");
    }
}

#[test]
fn compute_errors_match_serial_and_leave_y_untouched() {
    let (ty, rows, cols) = (GgmlType::Q8_0, 1000, 256);
    let data = matrix(ty, rows, cols, 1);
    let w = MatrixView::new(ty, rows, cols, &data).unwrap();
    let mut mv = ThreadedMatVec::new(3, Isa::detect());
    let unavailable = Isa::ALL.into_iter().find(|i| !i.is_available());
    // (x length, y length, isa)
    let mut cases = vec![
        (cols - 32, rows, Isa::detect()),
        (cols + 5, rows, Isa::detect()),
        (cols, rows - 1, Isa::detect()),
        (cols, rows + 16, Isa::detect()),
        (0, rows, Isa::detect()),
    ];
    if let Some(isa) = unavailable {
        cases.push((cols, rows, isa));
    }
    for (xl, yl, isa) in cases {
        let x = vector(xl, 2);
        let mut ys = vec![7.0f32; yl];
        let want = serial(isa, &w, &x, &mut ys);
        assert!(want.is_err());
        let mut yt = vec![7.0f32; yl];
        let got = if isa == Isa::detect() {
            mv.matvec(&w, &x, &mut yt)
        } else {
            ThreadedMatVec::new(3, isa).matvec(&w, &x, &mut yt)
        };
        assert_eq!(got, want, "x {xl}, y {yl}, {isa}");
        assert!(yt.iter().all(|&v| v == 7.0));
    }
    // The pool still works after errors.
    let x = vector(cols, 2);
    let mut y = vec![0f32; rows];
    mv.matvec(&w, &x, &mut y).unwrap();
}

#[test]
fn compute_pool_runs_every_index_once() {
    for threads in [0, 1, 2, 3, 8] {
        let mut pool = Pool::new(threads);
        assert_eq!(pool.threads(), threads.max(1));
        let counts: Vec<AtomicUsize> = (0..pool.threads()).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..2000 {
            pool.run(&|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        for c in &counts {
            assert_eq!(c.load(Ordering::Relaxed), 2000);
        }
    }
}

#[test]
fn compute_pool_for_each_runs_every_task_once() {
    for threads in [1, 2, 3, 5] {
        let mut pool = Pool::new(threads);
        for tasks in [0, 1, 2, 3, 7, 64, 1000] {
            let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..50 {
                pool.for_each(tasks, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            for c in &counts {
                assert_eq!(c.load(Ordering::Relaxed), 50);
            }
        }
    }
}

#[test]
fn compute_pool_for_each_does_not_wait_for_a_late_worker() {
    // Workers park between calls; the caller alone can finish tiny tasks before
    // any worker wakes, and then withdraws their offers.
    let mut pool = Pool::new(4);
    let count = AtomicUsize::new(0);
    for _ in 0..200 {
        pool.for_each(2, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        pool.run(&|_| {});
    }
    assert_eq!(count.load(Ordering::Relaxed), 400);
}

#[test]
fn compute_pool_wakes_parked_workers() {
    let mut pool = Pool::new(3);
    let total = AtomicUsize::new(0);
    for round in 0..5 {
        // Long enough for every worker to stop spinning and park.
        std::thread::sleep(Duration::from_millis(5));
        pool.run(&|i| {
            total.fetch_add(i + 1, Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), (round + 1) * 6);
    }
    // A slow job: the caller parks while waiting for a worker.
    pool.run(&|i| {
        if i == 2 {
            std::thread::sleep(Duration::from_millis(20));
        }
        total.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(total.load(Ordering::Relaxed), 33);
}

#[test]
fn compute_pool_propagates_panics_and_stays_usable() {
    let mut pool = Pool::new(3);
    for bad in 0..3 {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|i| {
                if i == bad {
                    panic!("job {i} fails on purpose");
                }
            })
        }));
        assert!(r.is_err(), "panic of index {bad} not propagated");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.for_each(10, &|i| {
                if i == bad {
                    panic!("task {i} fails on purpose");
                }
            })
        }));
        assert!(r.is_err(), "panic of task {bad} not propagated");
    }
    let seen = Mutex::new(Vec::new());
    pool.run(&|i| seen.lock().unwrap().push(i));
    let mut seen = seen.into_inner().unwrap();
    seen.sort_unstable();
    assert_eq!(seen, vec![0, 1, 2]);
}

#[test]
fn compute_pool_drop_joins_idle_and_parked_workers() {
    for sleep in [0, 5] {
        let mut pool = Pool::new(4);
        pool.run(&|_| {});
        std::thread::sleep(Duration::from_millis(sleep));
        drop(pool);
    }
    // A pool that never ran a job.
    drop(Pool::new(4));
}

#[test]
fn compute_matvec_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<ThreadedMatVec>();
    assert_send::<Pool>();
}

/// Waits and jobs of varying length around the polling budget (about 200 µs), so
/// that workers and caller park and wake at every point of the protocol. A lost
/// wake-up hangs this test.
#[test]
fn compute_pool_stress_around_the_spin_budget() {
    let mut pool = Pool::new(3);
    let count = AtomicUsize::new(0);
    let mut st = 1u64;
    let mut next = || {
        st = st
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        st >> 33
    };
    for round in 0..1500 {
        let idle = Duration::from_micros(next() % 400);
        if next() % 2 == 0 {
            std::thread::sleep(idle);
        } else {
            let t0 = std::time::Instant::now();
            while t0.elapsed() < idle {
                std::hint::spin_loop();
            }
        }
        let slow = (next() % 4) as usize;
        let busy = Duration::from_micros(next() % 300);
        let job = |i: usize| {
            if i == slow {
                let t0 = std::time::Instant::now();
                while t0.elapsed() < busy {
                    std::hint::spin_loop();
                }
            }
            count.fetch_add(1, Ordering::Relaxed);
        };
        if round % 2 == 0 {
            pool.run(&job);
        } else {
            pool.for_each(3, &job);
        }
        assert_eq!(count.load(Ordering::Relaxed), (round + 1) * 3);
    }
}
