//! A timeline of a decode, for `les bench --trace`: every device read, every
//! stall, each layer's routing, the output projection and each token, as
//! recorded by the threads that did them.
//!
//! [`Trace`] is a cheap handle the file device's I/O threads
//! ([`crate::flash::FileDevice::trace_into`]) and the bench loop share; it
//! keeps at most a fixed number of events (more are counted, not kept), so a
//! long run cannot grow it without bound. [`write_chrome`] writes the events in
//! the Chrome trace event format, which `chrome://tracing` and
//! <https://ui.perfetto.dev> open; [`disk_use`] sums per phase of a token how
//! busy the device was and how much of the stall waited with nothing in
//! flight, the table `les bench --trace` prints.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Events a [`Trace`] keeps by default: about 40 bytes each, a few thousand a
/// token on a 48-layer model.
pub const DEFAULT_CAPACITY: usize = 4 << 20;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum What {
    /// A device read (one chunk of a split read) on I/O lane `lane` (an I/O
    /// thread, or a place in the `io_uring`, where it ends when the scheduling
    /// thread takes its completion).
    Read {
        /// The I/O thread or ring place.
        lane: u16,
        /// A demand read (the computation needs it now), not a prefetch.
        urgent: bool,
        /// Bytes read.
        bytes: u32,
    },
    /// The computation waited for the device.
    Stall,
    /// The output projection.
    Output,
    /// Layer `0` routed its token (an instant): the layer's phase runs from
    /// here to the next layer's routing or the output projection.
    Layer(u16),
    /// Token `0` of the decode starts (an instant).
    Token(u32),
}

/// One event: what, and when (nanoseconds since the trace began).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// What happened.
    pub what: What,
    /// Start, ns.
    pub start: u64,
    /// End, ns (the start, for instants).
    pub end: u64,
}

struct Inner {
    t0: Instant,
    capacity: usize,
    events: Mutex<Vec<Event>>,
    dropped: AtomicU64,
}

/// A shared, bounded event log (clone it to share it).
#[derive(Clone)]
pub struct Trace(Arc<Inner>);

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trace")
            .field("capacity", &self.0.capacity)
            .finish_non_exhaustive()
    }
}

impl Trace {
    /// An empty trace keeping at most `capacity` events, starting now.
    pub fn new(capacity: usize) -> Trace {
        Trace(Arc::new(Inner {
            t0: Instant::now(),
            capacity,
            events: Mutex::new(Vec::new()),
            dropped: AtomicU64::new(0),
        }))
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.0.t0).as_nanos() as u64
    }

    /// Records `what` from `start` to `end`.
    pub fn span(&self, what: What, start: Instant, end: Instant) {
        let e = Event {
            what,
            start: self.ns(start),
            end: self.ns(end),
        };
        let mut v = self.0.events.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < self.0.capacity {
            v.push(e);
        } else {
            self.0.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records `what` at this moment.
    pub fn instant(&self, what: What) {
        let now = Instant::now();
        self.span(what, now, now);
    }

    /// The events so far, by start time.
    pub fn events(&self) -> Vec<Event> {
        let mut v = self
            .0
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        v.sort_by_key(|e| (e.start, e.end));
        v
    }

    /// Events not kept because the trace was full.
    pub fn dropped(&self) -> u64 {
        self.0.dropped.load(Ordering::Relaxed)
    }
}

/// Marks each layer's routing in a trace (a [`crate::watch::Watcher`]); marks
/// nothing until it has a trace.
#[derive(Clone, Debug, Default)]
pub struct LayerMarks(pub Option<Trace>);

impl<X> crate::watch::Watcher<X> for LayerMarks {
    fn begin_layer(&mut self, _: &X, layer: usize, _: &[u16]) {
        if let Some(t) = &self.0 {
            t.instant(What::Layer(layer as u16));
        }
    }
}

/// Writes runs of events (each a name, such as `"les (1/3)"`, and its events by
/// start time) as one Chrome trace: a process per run, the computation on
/// thread 0 (layers, stalls, the output projection, tokens), each I/O lane on
/// a thread of its own.
pub fn write_chrome<W: Write>(mut w: W, runs: &[(String, Vec<Event>)]) -> io::Result<()> {
    let us = |ns: u64| ns as f64 / 1e3;
    w.write_all(b"{\"traceEvents\":[\n")?;
    let mut first = true;
    let mut put = |w: &mut W, v: serde_json::Value| -> io::Result<()> {
        if !first {
            w.write_all(b",\n")?;
        }
        first = false;
        serde_json::to_writer(&mut *w, &v).map_err(io::Error::other)
    };
    for (pid, (name, events)) in runs.iter().enumerate() {
        put(
            &mut w,
            serde_json::json!({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                "args": {"name": name}}),
        )?;
        put(
            &mut w,
            serde_json::json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0,
                "args": {"name": "compute"}}),
        )?;
        let mut lanes: Vec<u16> = events
            .iter()
            .filter_map(|e| match e.what {
                What::Read { lane, .. } => Some(lane),
                _ => None,
            })
            .collect();
        lanes.sort_unstable();
        lanes.dedup();
        for lane in lanes {
            put(
                &mut w,
                serde_json::json!({"name": "thread_name", "ph": "M", "pid": pid,
                    "tid": 1 + lane as u32, "args": {"name": format!("I/O {lane}")}}),
            )?;
        }
        let last_end = events.iter().map(|e| e.end.max(e.start)).max().unwrap_or(0);
        // Layers and tokens are instants; shown as spans up to the next boundary.
        let bounds: Vec<&Event> = events
            .iter()
            .filter(|e| matches!(e.what, What::Layer(_) | What::Token(_) | What::Output))
            .collect();
        for (i, e) in bounds.iter().enumerate() {
            let next = |pred: &dyn Fn(&What) -> bool| {
                bounds[i + 1..]
                    .iter()
                    .find(|n| pred(&n.what))
                    .map(|n| n.start)
            };
            let (name, end) = match e.what {
                What::Layer(l) => (
                    format!("layer {l}"),
                    next(&|w| matches!(w, What::Layer(_) | What::Output | What::Token(_))),
                ),
                What::Token(t) => (format!("token {t}"), next(&|w| matches!(w, What::Token(_)))),
                _ => continue,
            };
            let end = end.unwrap_or(last_end);
            put(
                &mut w,
                serde_json::json!({"name": name, "cat": if matches!(e.what, What::Token(_)) {"token"} else {"layer"},
                    "ph": "X", "pid": pid, "tid": 0, "ts": us(e.start),
                    "dur": us(end.saturating_sub(e.start))}),
            )?;
        }
        for e in events {
            let v = match e.what {
                What::Read {
                    lane,
                    urgent,
                    bytes,
                } => serde_json::json!({"name": if urgent {"demand read"} else {"prefetch"},
                    "cat": "io", "ph": "X", "pid": pid, "tid": 1 + lane as u32,
                    "ts": us(e.start), "dur": us(e.end - e.start),
                    "args": {"bytes": bytes}}),
                What::Stall => serde_json::json!({"name": "stall", "cat": "stall", "ph": "X",
                    "pid": pid, "tid": 0, "ts": us(e.start), "dur": us(e.end - e.start)}),
                What::Output => serde_json::json!({"name": "output projection", "cat": "compute",
                    "ph": "X", "pid": pid, "tid": 0, "ts": us(e.start),
                    "dur": us(e.end - e.start)}),
                What::Layer(_) | What::Token(_) => continue,
            };
            put(&mut w, v)?;
        }
    }
    w.write_all(b"\n],\"displayTimeUnit\":\"ms\"}\n")?;
    Ok(())
}

/// Where a moment of a token falls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// From a token's start to its first layer's routing (the embedding, the
    /// first layers' predictions, the first attention).
    Start,
    /// From the routing of a layer in this group of layers to the next layer's
    /// routing (so the next layer's attention counts here).
    Layers(u16),
    /// The output projection, and what follows it until the next token.
    Output,
}

/// How busy the device was in one [`Phase`] of the decode's tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseUse {
    /// Time in the phase, ns.
    pub time: u64,
    /// Of it, time with at least one read in flight, ns.
    pub busy: u64,
    /// Sum over reads of their time in flight in the phase, ns (over `time`:
    /// the mean number of reads in flight).
    pub read_time: u64,
    /// Stall in the phase, ns.
    pub stall: u64,
    /// Of the stall, time with no read in flight (the computation waited on
    /// nothing the device was doing), ns.
    pub stall_idle: u64,
}

impl PhaseUse {
    /// Share of the phase's time with a read in flight (0 for an empty phase).
    pub fn busy_share(&self) -> f64 {
        self.busy as f64 / self.time.max(1) as f64
    }

    /// Mean reads in flight over the phase.
    pub fn mean_reads(&self) -> f64 {
        self.read_time as f64 / self.time.max(1) as f64
    }
}

/// Sums [`PhaseUse`] over the phases of `events` (by start time), layer `l`
/// counting in group `group_of(l)`. Time before the first token is left out.
pub fn disk_use(events: &[Event], group_of: impl Fn(u16) -> u16) -> Vec<(Phase, PhaseUse)> {
    // Phase boundaries, in time order.
    let mut bounds: Vec<(u64, Phase)> = Vec::new();
    for e in events {
        match e.what {
            What::Token(_) => bounds.push((e.start, Phase::Start)),
            What::Layer(l) => bounds.push((e.start, Phase::Layers(group_of(l)))),
            What::Output => bounds.push((e.start, Phase::Output)),
            _ => {}
        }
    }
    bounds.sort_by_key(|b| b.0);
    let Some(&(first, _)) = bounds.first() else {
        return Vec::new();
    };
    let last = events
        .iter()
        .map(|e| e.end.max(e.start))
        .max()
        .unwrap_or(first);
    // Every change of the reads in flight and of stalling, as a sweep.
    let mut edges: Vec<(u64, i32, i32)> = Vec::new(); // (time, reads delta, stall delta)
    for e in events {
        match e.what {
            What::Read { .. } if e.end > e.start => {
                edges.push((e.start, 1, 0));
                edges.push((e.end, -1, 0));
            }
            What::Stall if e.end > e.start => {
                edges.push((e.start, 0, 1));
                edges.push((e.end, 0, -1));
            }
            _ => {}
        }
    }
    edges.sort_by_key(|e| e.0);
    let mut out: Vec<(Phase, PhaseUse)> = Vec::new();
    let mut add = |phase: Phase, dt: u64, reads: i32, stalling: bool| {
        if dt == 0 {
            return;
        }
        let i = match out.iter().position(|(p, _)| *p == phase) {
            Some(i) => i,
            None => {
                out.push((phase, PhaseUse::default()));
                out.len() - 1
            }
        };
        let u = &mut out[i].1;
        u.time += dt;
        if reads > 0 {
            u.busy += dt;
        }
        u.read_time += dt * reads.max(0) as u64;
        if stalling {
            u.stall += dt;
            if reads <= 0 {
                u.stall_idle += dt;
            }
        }
    };
    let (mut reads, mut stalls) = (0i32, 0i32);
    let (mut ei, mut bi) = (0usize, 0usize);
    let mut t = first;
    // Reads that started before the first token.
    while ei < edges.len() && edges[ei].0 <= first {
        reads += edges[ei].1;
        stalls += edges[ei].2;
        ei += 1;
    }
    let mut phase = bounds[0].1;
    bi += 1;
    while t < last {
        let next_edge = edges.get(ei).map_or(u64::MAX, |e| e.0);
        let next_bound = bounds.get(bi).map_or(u64::MAX, |b| b.0);
        let next = next_edge.min(next_bound).min(last);
        add(phase, next - t, reads, stalls > 0);
        t = next;
        while ei < edges.len() && edges[ei].0 <= t {
            reads += edges[ei].1;
            stalls += edges[ei].2;
            ei += 1;
        }
        while bi < bounds.len() && bounds[bi].0 <= t {
            phase = bounds[bi].1;
            bi += 1;
        }
    }
    out.sort_by_key(|(p, _)| *p);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(what: What, start: u64, end: u64) -> Event {
        Event { what, start, end }
    }

    const READ: What = What::Read {
        lane: 0,
        urgent: false,
        bytes: 4096,
    };

    #[test]
    fn disk_use_splits_time_by_phase() {
        // Token at 0, layer 0 routes at 10, layer 1 (same group of 2) at 20,
        // output 30-40, next token at 50 and the trace ends at 60.
        let events = vec![
            ev(What::Token(0), 0, 0),
            ev(READ, 5, 25),  // busy 5-25
            ev(READ, 15, 18), // two in flight 15-18
            ev(What::Layer(0), 10, 10),
            ev(What::Stall, 12, 16), // stall with reads in flight
            ev(What::Layer(1), 20, 20),
            ev(What::Stall, 26, 28), // stall with none
            ev(What::Output, 30, 40),
            ev(What::Token(1), 50, 50),
            ev(READ, 52, 60),
        ];
        let u = disk_use(&events, |l| l / 2);
        let get = |p| u.iter().find(|(q, _)| *q == p).unwrap().1;
        let start = get(Phase::Start);
        assert_eq!(
            (start.time, start.busy, start.read_time),
            (10 + 10, 5 + 8, 5 + 8)
        );
        let layers = get(Phase::Layers(0));
        assert_eq!(layers.time, 20);
        assert_eq!(layers.busy, 15);
        assert_eq!(layers.read_time, 15 + 3);
        assert_eq!((layers.stall, layers.stall_idle), (4 + 2, 2));
        let out = get(Phase::Output);
        assert_eq!((out.time, out.busy, out.stall), (20, 0, 0));
        let total: u64 = u.iter().map(|(_, x)| x.time).sum();
        assert_eq!(total, 60);
    }

    #[test]
    fn a_full_trace_counts_what_it_drops() {
        let t = Trace::new(2);
        for _ in 0..5 {
            t.instant(What::Stall);
        }
        assert_eq!(t.events().len(), 2);
        assert_eq!(t.dropped(), 3);
    }

    #[test]
    fn chrome_trace_is_json_with_every_event() {
        let events = vec![
            ev(What::Token(0), 0, 0),
            ev(What::Layer(0), 1000, 1000),
            ev(
                What::Read {
                    lane: 3,
                    urgent: true,
                    bytes: 512,
                },
                1500,
                2500,
            ),
            ev(What::Stall, 2000, 2500),
            ev(What::Output, 3000, 4000),
        ];
        let mut buf = Vec::new();
        write_chrome(&mut buf, &[("les (1/1)".into(), events)]).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        let evs = v["traceEvents"].as_array().unwrap();
        let named = |n: &str| evs.iter().filter(|e| e["name"] == n).count();
        assert_eq!(named("demand read"), 1);
        assert_eq!(named("stall"), 1);
        assert_eq!(named("output projection"), 1);
        assert_eq!(named("layer 0"), 1);
        assert_eq!(named("token 0"), 1);
        let read = evs.iter().find(|e| e["name"] == "demand read").unwrap();
        assert_eq!(read["tid"], 4);
        assert_eq!(read["ts"], 1.5);
        assert_eq!(read["dur"], 1.0);
        let layer = evs.iter().find(|e| e["name"] == "layer 0").unwrap();
        assert_eq!(layer["dur"], 2.0, "layer 0 runs to the output projection");
    }
}
