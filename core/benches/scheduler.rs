//! The scheduler's own cost per token: a qwen3-30B-like routing (48 layers, 128
//! experts, top-8, predictions of 8) against a zero-latency simulated device that
//! moves no bytes, so only the planning is measured (slot lookups, eviction,
//! submissions, completions, compute order), for LES and on-demand and for small
//! and large slot pools.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use les_core::blockdev::sim::{Fault, SimConfig, SimDevice};
use les_core::blockdev::ReadRequest;
use les_core::schedule::{
    ExpertSource, Extent, Extents, LayerState, Next, Scheduler, SchedulerConfig,
};
use les_core::slots::{ExpertKey, IndexEntry, Slot};

const LAYERS: u16 = 48;
const EXPERTS: u16 = 128;
const TOP_K: usize = 8;
const EXPERT_BYTES: u32 = 1; // the device copies one byte: planning cost only

struct Src;
impl ExpertSource for Src {
    fn extents(&self, key: ExpertKey) -> Extents {
        let mut e = Extents::new();
        let _ = e.push(Extent {
            offset: (key.layer as u64 * EXPERTS as u64 + key.expert as u64) % 4096,
            len: EXPERT_BYTES,
            slot_offset: 0,
        });
        e
    }
}

fn routing(rng: &mut u64, out: &mut Vec<u16>) {
    out.clear();
    while out.len() < TOP_K {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        // Skewed popularity: low ids more often.
        let e = ((*rng % 1000) * (*rng % 1000) / 1000 * EXPERTS as u64 / 1000) as u16;
        if !out.contains(&e) {
            out.push(e);
        }
    }
}

fn bench(c: &mut Criterion) {
    let image = vec![0u8; 4096];
    let mut g = c.benchmark_group("scheduler_token");
    g.throughput(Throughput::Elements(1));
    for (name, config) in [
        ("les", SchedulerConfig::les()),
        ("on-demand", SchedulerConfig::on_demand()),
    ] {
        for slots in [64usize, 1536, 4096] {
            let mut mem = vec![0u8; slots];
            let sim = SimConfig {
                latency_ns: 0,
                ..SimConfig::default()
            };
            let mut dev: SimDevice<_, 64> =
                SimDevice::new(&image, &mut mem, 1, sim, |_: &ReadRequest| Fault::None);
            let mut sched = Scheduler::new(
                config,
                vec![Slot::EMPTY; slots],
                vec![IndexEntry::EMPTY; LAYERS as usize * EXPERTS as usize],
                vec![LayerState::INITIAL; LAYERS as usize],
                LAYERS,
                EXPERTS,
                EXPERT_BYTES,
            )
            .unwrap();
            let (mut rng, mut picks, mut next) = (0x1234_5678_9abc_def1u64, Vec::new(), Vec::new());
            routing(&mut rng, &mut next);
            g.bench_with_input(BenchmarkId::new(name, slots), &slots, |b, _| {
                b.iter(|| {
                    sched.begin_token();
                    for layer in 0..LAYERS {
                        std::mem::swap(&mut picks, &mut next);
                        routing(&mut rng, &mut next);
                        sched.begin_layer(layer, &picks, &mut dev, &Src).unwrap();
                        sched
                            .prefetch((layer + 1) % LAYERS, &next, &mut dev, &Src)
                            .unwrap();
                        loop {
                            match sched.next_blocking(&mut dev, &Src).unwrap() {
                                Next::Compute { index, .. } => {
                                    sched.finish::<()>(black_box(index)).unwrap()
                                }
                                Next::Done => break,
                                Next::Wait
                                | Next::ComputeFirst { .. }
                                | Next::ComputeRest { .. } => unreachable!(),
                            }
                        }
                    }
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
