//! End-to-end tests of `les bench`: the JSON contract, identical tokens across
//! schedules and repeats (equal to `les run` with the same sampler), the sweep.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value as Json;

const PROMPT: &str = "Once upon a time";

fn les(args: &[&str]) -> (String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_les"))
        .args(args)
        .output()
        .expect("les runs");
    let (out, err) = (
        String::from_utf8(o.stdout).unwrap(),
        String::from_utf8(o.stderr).unwrap(),
    );
    assert!(o.status.success(), "les {args:?} failed: {err}");
    (out, err)
}

/// A packed tiny model (8 experts per layer) in a fresh directory, under the
/// build directory (whose disk takes `O_DIRECT` reads, as CI's does; a tmpfs
/// `/tmp` would not, and `--io-engine auto` would fall back to threads).
fn packed_tiny(name: &str) -> PathBuf {
    packed_tiny_of("qwen3moe", name)
}

/// [`packed_tiny`] of architecture `arch`.
fn packed_tiny_of(arch: &str, name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("les-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (plain, packed) = (dir.join("tiny.gguf"), dir.join("tiny.packed.gguf"));
    let (p, q) = (plain.to_str().unwrap(), packed.to_str().unwrap());
    les(&[
        "synth", "--arch", arch, "--preset", "tiny", "--quiet", "-o", p,
    ]);
    les(&["pack", "--quiet", p, "-o", q]);
    packed
}

fn tokens(v: &Json) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn cleanup(model: &Path) {
    std::fs::remove_dir_all(model.parent().unwrap()).unwrap();
}

/// `--io-engine auto` issues experts larger than one chunk from I/O threads.
#[test]
fn bench_auto_engine_uses_threads_for_experts_of_several_chunks() {
    let model = packed_tiny("engine");
    let m = model.to_str().unwrap();
    for (chunk, want) in [("4KiB", "threads"), ("512KiB", "uring")] {
        let args = ["bench", "-m", m, "--slots", "6", "-n", "2", "--json"];
        let (out, _) = les(&[&args[..], &["--schedules", "les", "--io-chunk", chunk]].concat());
        let j: Json = serde_json::from_str(&out).unwrap();
        assert_eq!(
            j["schedules"]["les"]["io_engine"], want,
            "--io-chunk {chunk}"
        );
    }
    cleanup(&model);
}

#[test]
fn bench_json_has_the_contract_keys_and_run_s_tokens() {
    let model = packed_tiny("json");
    let m = model.to_str().unwrap();
    let (out, _) = les(&[
        "bench",
        "-m",
        m,
        "--slots",
        "6",
        "-n",
        "12",
        "--prompt",
        PROMPT,
        "--json",
        "--repeat",
        "2",
        "--schedules",
        "on-demand,les,resident",
        "-t",
        "1",
        "--seed",
        "1",
    ]);
    let j: Json = serde_json::from_str(&out).unwrap();
    assert_eq!(j["identical_tokens"], true);
    // The kernels in use: their ISA, and this CPU's weight prefetch distance.
    assert!(
        j["kernels"]["isa"].as_str().is_some_and(|s| !s.is_empty()),
        "{j}"
    );
    assert!(j["kernels"]["prefetch_bytes"].as_u64().is_some(), "{j}");
    for s in ["on-demand", "les", "resident"] {
        let r = &j["schedules"][s];
        for k in ["tok_s", "bytes_per_token", "hit_rate", "overlap_efficiency"] {
            assert!(r[k].as_f64().is_some_and(f64::is_finite), "{s}.{k}: {r}");
        }
        // Shares are shares.
        let share = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{s}.{k}: {r}"));
        for k in [
            "hit_rate",
            "ready_hit_rate",
            "overlap_efficiency",
            "device_busy_share",
        ] {
            assert!((0.0..=1.0).contains(&share(k)), "{s}.{k}: {r}");
        }
        assert!(share("ready_hit_rate") <= share("hit_rate"), "{s}: {r}");
        // The ready hit rate leaves out the picks whose prefetch was in flight.
        let n = |k: &str| r[k].as_u64().unwrap() as f64;
        if s != "resident" {
            let picks = n("hits") + n("late_hits") + n("misses");
            assert!(picks > 0.0, "{s}: {r}");
            assert!(
                (share("ready_hit_rate") - n("hits") / picks).abs() < 1e-6,
                "{s}: {r}"
            );
            assert!(
                (share("hit_rate") - (n("hits") + n("late_hits")) / picks).abs() < 1e-6,
                "{s}: {r}"
            );
        }
        assert_eq!(r["tok_s_runs"].as_array().unwrap().len(), 2, "{r}");
        // Every speedup is the schedule's median run over on-demand's.
        let want =
            r["tok_s"].as_f64().unwrap() / j["schedules"]["on-demand"]["tok_s"].as_f64().unwrap();
        assert!(
            (j["speedup"][s].as_f64().unwrap() - want).abs() < 1e-9,
            "{s}: {j}"
        );
        // Of two runs, the median run is the faster one.
        let runs: Vec<f64> = r["tok_s_runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(
            r["tok_s"].as_f64().unwrap(),
            runs[0].max(runs[1]),
            "{s}: {r}"
        );
        // Predictions are les's alone; the others' precision is no figure at all.
        if s == "les" {
            for k in ["prediction_precision", "prediction_recall"] {
                assert!((0.0..=1.0).contains(&share(k)), "{s}.{k}: {r}");
            }
        } else {
            assert!(r["prediction_precision"].is_null(), "{s}: {r}");
            assert!(r["prediction_recall"].is_null(), "{s}: {r}");
        }
        // The hypervisor's share of CPU time: null where the OS does not tell
        // it, or when the decode was shorter than its clock tick (as here).
        let steal = &r["cpu_steal"];
        assert!(
            steal.is_null() || steal.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x)),
            "{r}"
        );
    }
    // Each round's ratio, from that round's runs.
    let runs = |s: &str| j["schedules"][s]["tok_s_runs"].as_array().unwrap().clone();
    let rounds = j["speedup_rounds"]["les"].as_array().unwrap();
    assert_eq!(rounds.len(), 2, "{j}");
    for (k, r) in rounds.iter().enumerate() {
        let want = runs("les")[k].as_f64().unwrap() / runs("on-demand")[k].as_f64().unwrap();
        assert!(
            (r.as_f64().unwrap() - want).abs() < 1e-9,
            "round {k}: {r} vs {want}"
        );
    }
    // The overlap figures use the mean of the probes just before and just after
    // the run, or on-demand's bandwidth while it waited where that was higher.
    for s in ["on-demand", "les"] {
        let r = &j["schedules"][s];
        let used = r["device_bw"].as_f64().unwrap();
        let p: Vec<f64> = r["device_bw_probes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert!(p.len() == 2 && p.iter().all(|&b| b > 0.0), "{s}: {p:?}");
        let mean = (p[0] + p[1]) / 2.0;
        assert!(used >= mean * (1.0 - 1e-12), "{s}: {used} vs probes {p:?}");
    }
    // The speedup perfect overlap would give is reported beside the speedup.
    let bound = j["speedup_bound"]["les"].as_f64().unwrap();
    assert!(bound.is_finite() && bound > 0.0, "{bound}");
    let od = &j["schedules"]["on-demand"];
    assert!(
        od["bytes_per_token"].as_f64().unwrap() > 0.0,
        "6 of 32 slots: reads"
    );
    assert_eq!(j["schedules"]["resident"]["bytes_per_token"], 0.0);
    // How long the device had reads outstanding: some of the decode where it
    // read, none where it did not.
    for s in ["on-demand", "les"] {
        let b = j["schedules"][s]["device_busy_share"].as_f64().unwrap();
        assert!(b > 0.0 && b <= 1.0, "{s}: busy {b}");
    }
    assert_eq!(j["schedules"]["resident"]["device_busy_share"], 0.0);
    // `--io-engine auto` (the default): this preset's experts are one read
    // each, so `io_uring` issues them.
    for s in ["on-demand", "les"] {
        assert_eq!(j["schedules"][s]["io_engine"], "uring", "{s}");
    }
    assert!(j["schedules"]["resident"]["io_engine"].is_null());
    // Each layer's share of the stall and of the picks: they add up to the
    // schedule's totals; nothing streams in the resident run.
    for s in ["on-demand", "les"] {
        let r = &j["schedules"][s];
        let layers = r["layer_costs"].as_array().unwrap();
        assert!(!layers.is_empty(), "{r}");
        let sum = |k: &str| -> f64 { layers.iter().map(|l| l[k].as_f64().unwrap()).sum() };
        for k in ["hits", "late_hits", "misses"] {
            assert_eq!(sum(k), r[k].as_f64().unwrap(), "{s}.{k}");
        }
        let stall = r["stall_s_per_token"].as_f64().unwrap();
        assert!((sum("stall_s_per_token") - stall).abs() < 1e-6, "{s}: {r}");
        for (i, l) in layers.iter().enumerate() {
            assert_eq!(l["layer"], i as u64);
        }
    }
    assert_eq!(
        j["schedules"]["resident"]["layer_costs"],
        serde_json::json!([])
    );
    // The decode in quarters (12 tokens: 3 each), in order: their tokens,
    // bytes and stalls add up to the run's.
    for s in ["on-demand", "les", "resident"] {
        let r = &j["schedules"][s];
        let parts = r["stretches"].as_array().unwrap();
        let tokens: Vec<u64> = parts
            .iter()
            .map(|p| p["tokens"].as_u64().unwrap())
            .collect();
        assert_eq!(tokens, [3, 3, 3, 3], "{s}: {r}");
        let total = |k: &str| -> f64 {
            parts
                .iter()
                .map(|p| p[k].as_f64().unwrap() * p["tokens"].as_f64().unwrap())
                .sum::<f64>()
                / 12.0
        };
        for k in ["bytes_per_token", "stall_s_per_token"] {
            let want = r[k].as_f64().unwrap();
            assert!(
                (total(k) - want).abs() <= 1e-9 * want.max(1.0),
                "{s}.{k}: {r}"
            );
        }
        assert!(
            parts.iter().all(|p| p["tok_s"].as_f64().unwrap() > 0.0),
            "{r}"
        );
    }
    assert!(
        j["schedules"]["on-demand"]["stretches"][0]["bytes_per_token"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    // No cache without prediction hits more often than Belady's optimal one over
    // the same routing: not LRU (on-demand), and it can miss (6 of 32 slots).
    let optimal = j["optimal_hit_rate"].as_f64().unwrap();
    assert!(optimal < 1.0, "{optimal}");
    assert!(
        optimal >= od["hit_rate"].as_f64().unwrap(),
        "{optimal} vs {od}"
    );
    let les_tokens = tokens(&j["schedules"]["les"]["tokens"]);
    assert_eq!(les_tokens.len(), 12);
    assert_eq!(les_tokens, tokens(&od["tokens"]));

    // The bench samples exactly as `les run` does with the same seed, except
    // that it does not stop at an end-of-generation token (as llama-bench): the
    // run's tokens are the bench's up to the one it stopped at (with seed 1,
    // all twelve).
    let (run, _) = les(&[
        "run", "-m", m, "-p", PROMPT, "-n", "12", "--temp", "0.8", "--seed", "1", "--json", "-t",
        "1",
    ]);
    let r: Json = serde_json::from_str(&run).unwrap();
    let run_tokens = tokens(&r["tokens"]);
    assert_eq!(run_tokens[..], les_tokens[..run_tokens.len()], "{r}");
    let stop = r["stats"]["stop"].as_str().unwrap();
    assert!(
        (stop == "length") == (run_tokens.len() == 12) && (stop == "length" || stop == "eog"),
        "{r}"
    );
    cleanup(&model);
}

#[test]
fn bench_sweep_reports_every_budget_and_the_verdicts() {
    let model = packed_tiny("sweep");
    let (out, _) = les(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "--sweep",
        "25,100",
        "-n",
        "6",
        "--repeat",
        "2",
        "-t",
        "1",
    ]);
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.ends_with('%'))
        })
        .collect();
    assert_eq!(rows.len(), 4, "{out}");
    for (row, (budget, schedule)) in rows.iter().zip([
        ("25%", "on-demand"),
        ("25%", "les"),
        ("100%", "on-demand"),
        ("100%", "les"),
    ]) {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!((cols[0], cols[2]), (budget, schedule), "{out}");
    }
    assert!(out.contains("les never slower than on-demand: "), "{out}");
    // At 100% nothing is evicted once read: les (with its prefetches) holds at
    // least what LRU holds, so the verdict is a yes or a no, never n/a.
    let hits = out
        .lines()
        .find_map(|l| l.strip_prefix("les hit rate (ready when picked) >= LRU at every budget: "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(hits == "yes" || hits == "no", "{out}");
    assert!(out.contains("medians of 2 interleaved runs"), "{out}");
    assert!(
        out.contains("hit rate of the optimal cache without prediction (Belady's): 25% "),
        "{out}"
    );
    cleanup(&model);
}

#[test]
fn bench_sweep_below_one_layer_runs_at_the_minimum() {
    // 1% of the tiny model's experts is less than one expert: the point runs with
    // the two slots one layer's picks need, as a budget of exactly that would.
    let model = packed_tiny("sweep-min");
    let (out, _) = les(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "--sweep",
        "1",
        "-n",
        "2",
        "-t",
        "1",
    ]);
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|c| c.first() == Some(&"1%"))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(rows.iter().all(|c| c[1] == "2"), "{out}");
    cleanup(&model);
}

#[test]
fn bench_sweep_json_is_one_object_with_every_budget() {
    let model = packed_tiny("sweep-json");
    let (out, _) = les(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "--sweep",
        "25,100",
        "-n",
        "4",
        "-t",
        "1",
        "--json",
    ]);
    let j: Json = serde_json::from_str(&out).expect("one JSON object, no table");
    let budgets = j["budgets"].as_array().unwrap();
    assert_eq!(budgets.len(), 2, "{j}");
    for (b, pct) in budgets.iter().zip([25.0, 100.0]) {
        assert_eq!(b["percent"], pct);
        assert!(b["slots"].as_u64().unwrap() > 0);
        assert_eq!(b["identical_tokens"], true);
        for s in ["on-demand", "les"] {
            let r = &b["schedules"][s];
            for k in ["tok_s", "bytes_per_token", "hit_rate", "overlap_efficiency"] {
                assert!(r[k].as_f64().is_some_and(f64::is_finite), "{s}.{k}: {r}");
            }
        }
        assert_eq!(b["speedup"]["on-demand"], 1.0);
        let optimal = b["optimal_hit_rate"].as_f64().unwrap();
        assert!(optimal >= b["schedules"]["on-demand"]["hit_rate"].as_f64().unwrap());
    }
    assert!(j["les_never_slower"].is_boolean());
    // The hit-rate verdict is les's ready hit rate against LRU's, budget by budget.
    let rate = |b: &Json, s: &str, k: &str| b["schedules"][s][k].as_f64().unwrap();
    let want = budgets
        .iter()
        .all(|b| rate(b, "les", "ready_hit_rate") >= rate(b, "on-demand", "hit_rate"));
    assert_eq!(j["les_hit_rate_at_least_lru"], want, "{j}");
    assert!(j["kernels"]["prefetch_bytes"].as_u64().is_some(), "{j}");
    cleanup(&model);
}

#[test]
fn bench_text_prints_the_table_and_each_round_s_speedup() {
    let model = packed_tiny("text");
    let (out, _) = les(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "--slots",
        "6",
        "-n",
        "4",
        "--repeat",
        "3",
        "-t",
        "1",
    ]);
    assert!(out.contains("les: median of 3 runs (tok/s "), "{out}");
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("les: speedup per round "))
        .unwrap_or_else(|| panic!("no per-round line: {out}"));
    let (list, median) = line.split_once(" (median ").unwrap();
    let mut v: Vec<f64> = list.split(' ').map(|x| x.parse().unwrap()).collect();
    assert_eq!(v.len(), 3, "{line}");
    v.sort_by(f64::total_cmp);
    let median: f64 = median.trim_end_matches("x)").parse().unwrap();
    assert!((median - v[1]).abs() < 0.006, "{line}");
    assert!(!out.contains("on-demand: speedup per round"), "{out}");
    let busy = out
        .lines()
        .find_map(|l| l.strip_prefix("device busy (reads outstanding) while decoding: "))
        .unwrap_or_else(|| panic!("no device busy line: {out}"));
    assert!(
        busy.starts_with("on-demand ") && busy.contains(", les "),
        "{busy}"
    );
    for s in ["on-demand", "les"] {
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{s}: stall ms/token by layers: ")))
            .unwrap_or_else(|| panic!("no per-layer stall line for {s}: {out}"));
        // Runs of layers from the first: "0-0 1.2, 1-1 0.0, ...".
        assert!(line.starts_with("0-"), "{line}");
        assert!(
            out.contains(&format!(
                "{s}: experts not ready when picked (misses + late prefetches) per token by layers: 0-"
            )),
            "{out}"
        );
    }
    cleanup(&model);
}

/// `--trace`: a Chrome trace of every run (reads on I/O lanes, stalls, layers,
/// tokens, output projections) and, per schedule, how busy the device was in
/// each phase of a token, adding up to the decode's time and stall.
#[test]
fn bench_trace_records_every_run_and_where_the_device_was_busy() {
    let model = packed_tiny("trace");
    let trace = model.parent().unwrap().join("trace.json");
    let (n_tokens, n_layers) = (8u64, 4u64); // the tiny preset: 4 MoE layers
    let (out, _) = les(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "--slots",
        "6",
        "-n",
        &n_tokens.to_string(),
        "--repeat",
        "2",
        "--schedules",
        "on-demand,les,resident",
        "-t",
        "1",
        "--json",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let j: Json = serde_json::from_str(&out).unwrap();
    for s in ["on-demand", "les", "resident"] {
        let r = &j["schedules"][s];
        let phases = r["disk_use"]
            .as_array()
            .unwrap_or_else(|| panic!("{s}: {r}"));
        let names: Vec<&str> = phases
            .iter()
            .map(|p| p["phase"].as_str().unwrap())
            .collect();
        assert_eq!(names.first(), Some(&"token start"), "{s}: {names:?}");
        assert_eq!(names.last(), Some(&"output"), "{s}: {names:?}");
        assert!(names.contains(&"layers 0-0"), "{s}: {names:?}");
        let sum = |k: &str| phases.iter().map(|p| p[k].as_f64().unwrap()).sum::<f64>();
        for p in phases {
            let busy = p["disk_busy"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&busy), "{s}: {p}");
            let (idle, all) = (
                p["stall_nothing_read_s_per_token"].as_f64().unwrap(),
                p["stall_s_per_token"].as_f64().unwrap(),
            );
            assert!(idle <= all, "{s}: {p}");
        }
        // The phases cover the decode (less the moments before the first
        // token's start and after the last output projection) and its stall.
        let per_token = 1.0 / r["tok_s"].as_f64().unwrap();
        let time = sum("s_per_token");
        assert!(
            time <= per_token * 1.001 && time >= per_token * 0.5,
            "{s}: {time} of {per_token}"
        );
        let stall = r["stall_s_per_token"].as_f64().unwrap();
        assert!(
            (sum("stall_s_per_token") - stall).abs() <= 0.05 * stall + 1e-4,
            "{s}: {r}"
        );
        // Nothing is read during the output projection (the next token's reads
        // depend on the token it picks), nor ever by the resident schedule.
        let output = phases.last().unwrap();
        if s == "resident" {
            assert_eq!(sum("disk_busy"), 0.0, "{r}");
        }
        assert!(output["disk_busy"].as_f64().unwrap() < 0.5, "{s}: {output}");
    }
    let t: Json = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let runs: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        runs,
        [
            "on-demand (1/2)",
            "les (1/2)",
            "resident (1/2)",
            "on-demand (2/2)",
            "les (2/2)",
            "resident (2/2)"
        ]
    );
    for (pid, run) in runs.iter().enumerate() {
        let of = |name: &str| {
            events
                .iter()
                .filter(|e| e["pid"] == pid && e["name"].as_str().unwrap().starts_with(name))
                .count() as u64
        };
        assert_eq!(of("token "), n_tokens, "{run}");
        assert_eq!(of("layer "), n_tokens * n_layers, "{run}");
        assert_eq!(of("output projection"), n_tokens, "{run}");
        let reads = of("demand read") + of("prefetch");
        if run.starts_with("resident") {
            assert_eq!(reads, 0, "{run}");
        } else {
            assert!(of("demand read") > 0, "{run}");
        }
        if run.starts_with("les") {
            assert!(of("prefetch") > 0, "{run}");
        }
        if run.starts_with("on-demand") {
            assert_eq!(of("prefetch"), 0, "{run}: on-demand never prefetches");
        }
    }
    for e in events.iter().filter(|e| e["ph"] == "X") {
        assert!(
            e["dur"].as_f64().unwrap() >= 0.0 && e["ts"].as_f64().unwrap() >= 0.0,
            "{e}"
        );
    }
    // The text report prints the same table per schedule.
    let (out, err) = les(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "--slots",
        "6",
        "-n",
        "2",
        "-t",
        "1",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    for s in ["on-demand", "les"] {
        let table = out
            .split_once(&format!(
                "{s}: where the device was busy (from the trace), per token:\n"
            ))
            .unwrap_or_else(|| panic!("no table for {s}: {out}"))
            .1;
        let rows: Vec<&str> = table.lines().take_while(|l| l.starts_with("  ")).collect();
        assert!(rows[0].contains("disk busy"), "{rows:?}");
        assert!(rows[1].starts_with("  token start"), "{rows:?}");
        assert!(rows.last().unwrap().starts_with("  output"), "{rows:?}");
        assert_eq!(rows.len(), 1 + 1 + n_layers as usize + 1, "{rows:?}");
    }
    assert!(err.contains("wrote the trace of 2 runs"), "{err}");
    cleanup(&model);
}

#[test]
fn bench_rejects_bad_arguments_with_an_error_naming_them() {
    let model = packed_tiny("bad");
    let m = model.to_str().unwrap();
    for (args, says) in [
        (
            vec!["--sweep", "0"],
            "'--sweep <SWEEP>': 0% is not in (0, 100]",
        ),
        (
            vec!["--slots", "4", "--io-chunk", "100"],
            "--io-chunk 100: at least 4KiB",
        ),
        (vec!["--slots", "4", "--repeat", "0"], "'--repeat <REPEAT>'"),
        (
            vec!["--slots", "4", "--lookahead-depth", "3"],
            "'--lookahead-depth <LOOKAHEAD_DEPTH>'",
        ),
        (
            vec!["--sweep", "50", "--trace", "t.json"],
            "cannot be used with '--trace <FILE>'",
        ),
        (
            vec!["--slots", "4", "--trace", "/nonexistent-dir/t.json"],
            "cannot write the trace /nonexistent-dir/t.json",
        ),
        (
            vec!["--slots", "4", "--schedules", "les,on-demand,les"],
            "--schedules names les twice",
        ),
        (
            vec!["--sweep", "50", "--schedules", "les,les"],
            "--schedules names les twice",
        ),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_les"))
            .args([&["bench", "-m", m][..], &args].concat())
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&o.stderr);
        let first = err
            .lines()
            .find(|l| l.starts_with("error: "))
            .unwrap_or_else(|| panic!("{args:?}: {err}"));
        assert!(first.contains(says), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    cleanup(&model);
}

/// Prediction precision and recall are the decode's: one token decoded after a
/// prompt of several predicts each layer's top-k once (a layer whose
/// prefetching is on), not once for each of the prompt's positions too.
#[test]
fn bench_predictions_are_counted_over_the_decode_only() {
    let model = packed_tiny("predictions");
    let m = model.to_str().unwrap();
    let args = [
        "bench",
        "-m",
        m,
        "--slots",
        "6",
        "-n",
        "1",
        "--schedules",
        "les",
        "--json",
    ];
    let (out, _) = les(&[
        &args[..],
        &[
            "--prompt",
            "Once upon a time, in a land far away, there lived",
        ],
    ]
    .concat());
    let j: Json = serde_json::from_str(&out).unwrap();
    let layers = j["schedules"]["les"]["layers"].as_array().unwrap();
    assert!(!layers.is_empty(), "{j}");
    for l in layers {
        // The tiny preset picks 2 experts a layer, and les predicts as many.
        assert_eq!(l["predicted"], 2, "{l}");
        let p = l["precision"].as_f64().unwrap();
        assert!([0.0, 0.5, 1.0].contains(&p), "{l}");
    }
    cleanup(&model);
}

/// A sweep without les, or without on-demand, has nothing to judge: its
/// verdicts say so (null in JSON) instead of a vacuous yes.
#[test]
fn bench_sweep_verdicts_need_both_schedules() {
    let model = packed_tiny("sweep-verdicts");
    let m = model.to_str().unwrap();
    for only in ["on-demand", "les"] {
        let args = [
            "bench",
            "-m",
            m,
            "--sweep",
            "50",
            "-n",
            "2",
            "-t",
            "1",
            "--schedules",
            only,
        ];
        let (out, _) = les(&args);
        for v in [
            "les never slower than on-demand: ",
            "les hit rate (ready when picked) >= LRU at every budget: ",
        ] {
            let line = out
                .lines()
                .find(|l| l.starts_with(v))
                .unwrap_or_else(|| panic!("{out}"));
            assert!(
                line.ends_with("n/a (needs les and on-demand in --schedules)"),
                "{only}: {line}"
            );
        }
        let (out, _) = les(&[&args[..], &["--json"]].concat());
        let j: Json = serde_json::from_str(&out).unwrap();
        assert!(j["les_never_slower"].is_null(), "{only}: {j}");
        assert!(j["les_hit_rate_at_least_lru"].is_null(), "{only}: {j}");
    }
    cleanup(&model);
}

/// `--prefill-batches`: one run per schedule and batch size, each schedule's
/// speedup over its first size, fewer bytes read per token in batches, and the
/// same last-position logits everywhere.
#[test]
fn bench_prefill_batches_compares_batch_sizes_with_identical_logits() {
    let m = packed_tiny("prefill");
    let (out, _) = les(&[
        "bench",
        "-m",
        m.to_str().unwrap(),
        "--slots",
        "4",
        "--schedules",
        "resident,les",
        "--prefill-batches",
        "1,8",
        "--prefill-tokens",
        "48",
        "--json",
    ]);
    let v: Json = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["identical_logits"], true);
    assert_eq!(v["prompt_tokens"], 48);
    let runs = v["runs"].as_array().unwrap();
    let row = |s: &str, b: u64| {
        runs.iter()
            .find(|r| r["schedule"] == s && r["batch"] == b)
            .unwrap_or_else(|| panic!("no {s} row at batch {b}: {v}"))
    };
    assert_eq!(runs.len(), 4);
    assert_eq!(row("les", 1)["speedup"], 1.0);
    assert!(row("resident", 8)["tok_s"].as_f64().unwrap() > 0.0);
    assert_eq!(row("resident", 1)["bytes_per_token"], 0.0);
    let (one, eight) = (
        row("les", 1)["bytes_per_token"].as_f64().unwrap(),
        row("les", 8)["bytes_per_token"].as_f64().unwrap(),
    );
    assert!(
        eight < one,
        "batches read each expert once: {eight} < {one}"
    );
    // The shares of the time blocked on reads and with reads outstanding:
    // none without reads, some while streaming.
    for r in runs {
        for key in ["stall_share", "busy_share"] {
            let x = r[key].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&x), "{key} {x}: {r}");
        }
    }
    assert_eq!(row("resident", 8)["busy_share"], 0.0);
    assert!(row("les", 1)["busy_share"].as_f64().unwrap() > 0.0);
    cleanup(&m);
}

/// `--parallel`: one run per schedule and count of sequences decoded side by
/// side, each schedule's throughput over its first count, every sequence's
/// tokens the same in each run that decoded it; counts out of range and
/// other modes beside it are usage errors.
#[test]
fn bench_parallel_decodes_sequences_side_by_side() {
    let m = packed_tiny("parallel");
    let (out, _) = les(&[
        "bench",
        "-m",
        m.to_str().unwrap(),
        "--slots",
        "6",
        "--schedules",
        "resident,on-demand,les",
        "--parallel",
        "1,3",
        "-n",
        "12",
        "--json",
    ]);
    let v: Json = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["identical_tokens"], true, "{v}");
    assert_eq!(v["n_tokens"], 12);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 6, "{v}");
    let row = |s: &str, n: u64| {
        runs.iter()
            .find(|r| r["schedule"] == s && r["sequences"] == n)
            .unwrap_or_else(|| panic!("no {s} row for {n}: {v}"))
    };
    for s in ["resident", "on-demand", "les"] {
        assert_eq!(row(s, 1)["speedup"], 1.0);
        let (all, each) = (
            row(s, 3)["tok_s"].as_f64().unwrap(),
            row(s, 3)["tok_s_per_sequence"].as_f64().unwrap(),
        );
        assert!(all > 0.0 && (all / 3.0 - each).abs() < 1e-9, "{v}");
    }
    assert_eq!(row("resident", 3)["bytes_per_token"], 0.0);
    assert!(row("on-demand", 3)["bytes_per_token"].as_f64().unwrap() > 0.0);
    let (text, _) = les(&[
        "bench",
        "-m",
        m.to_str().unwrap(),
        "--slots",
        "6",
        "--parallel",
        "2",
        "-n",
        "4",
    ]);
    assert!(
        text.contains("sequences") && text.contains(": yes"),
        "{text}"
    );
    for extra in [
        &["--parallel", "0"][..],
        &["--parallel", "65"],
        &["--parallel", "2", "--prefill-batches", "8"],
        &["--parallel", "2", "--sweep", "25"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_les"))
            .args(["bench", "-m", m.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
    }
    cleanup(&m);
}

/// `--parallel` with `--speculate ngram` (or `model`) and a prompt a
/// sequence: every count plainly and with each sequence verifying its own
/// drafts in the shared passes, the same tokens either way; drafts from
/// prompt lookup or a draft model (a session a sequence), not the MTP
/// block, and several prompts only side by side.
#[test]
fn bench_parallel_speculates_each_sequence_on_its_own() {
    let m = packed_tiny("parallel_spec");
    let prompts = [
        "one two three four one two three four one two",
        "a b c a b c a b c a b",
        "The quick brown fox",
    ];
    // The model unpacked drafts for itself.
    let draft = m.with_file_name("tiny.gguf");
    for how in [
        ["--speculate", "ngram", "--ngram-min", "2"],
        [
            "--speculate",
            "model",
            "--model-draft",
            draft.to_str().unwrap(),
        ],
    ] {
        let mut args = vec![
            "bench",
            "-m",
            m.to_str().unwrap(),
            "--slots",
            "6",
            "--schedules",
            "on-demand,les",
            "--parallel",
            "1,3",
            how[0],
            how[1],
            how[2],
            how[3],
            "--draft-max",
            "4",
            "--draft-fixed",
            "--temp",
            "0",
            "-n",
            "24",
            "--json",
        ];
        for p in prompts {
            args.extend(["--prompt", p]);
        }
        let (out, _) = les(&args);
        let v: Json = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["identical_tokens"], true, "{v}");
        assert_eq!(v["prompt_tokens"].as_array().unwrap().len(), 3, "{v}");
        let runs = v["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 8, "{v}");
        let mut drafted = 0;
        for r in runs {
            let (d, a) = (
                r["drafted"].as_u64().unwrap(),
                r["accepted"].as_u64().unwrap(),
            );
            assert!(a <= d, "{r}");
            if r["decode"] == "plain" {
                assert_eq!((d, r["tokens_per_pass"].as_f64().unwrap()), (0, 1.0), "{r}");
            } else {
                assert_eq!(r["decode"], how[1], "{r}");
                drafted += d;
                // Passes: each sequence's tokens less those accepted, at most.
                let n = r["sequences"].as_u64().unwrap();
                assert!(r["passes"].as_u64().unwrap() <= 24 * n - a, "{r}");
            }
        }
        assert!(drafted > 0, "{how:?}: no drafts were verified: {v}");
    }
    for (extra, says) in [
        (
            &["--parallel", "2", "--speculate", "mtp"][..],
            "multi-token-prediction",
        ),
        (&["--prompt", "a", "--prompt", "b"], "for --parallel"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_les"))
            .args(["bench", "-m", m.to_str().unwrap(), "--slots", "6"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{extra:?}: {err}"
        );
    }
    cleanup(&m);
}

/// `--parallel --speculate mtp` on a qwen35moe: each sequence's MTP block
/// (a fork of the drafter) shown its own sequence's prompt and kept tokens,
/// drafting in the shared passes; the tokens are plain decoding's.
#[test]
fn bench_parallel_drafts_with_each_sequences_mtp_block() {
    let packed = packed_tiny_of("qwen35moe", "parallel-mtp");
    let q = packed.to_str().unwrap();
    let (out, err) = les(&[
        "bench",
        "-m",
        q,
        "--slots",
        "6",
        "--schedules",
        "les",
        "--parallel",
        "1,2",
        "--speculate",
        "mtp",
        "--draft-max",
        "2",
        "--draft-fixed",
        "--temp",
        "0",
        "-n",
        "12",
        "--prompt",
        "one two three",
        "--prompt",
        "four five",
        "--json",
    ]);
    let v: Json = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["identical_tokens"], true, "{v}");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4, "{v}");
    let mtp: Vec<&Json> = runs.iter().filter(|r| r["decode"] == "mtp").collect();
    assert_eq!(mtp.len(), 2, "{v}");
    assert!(
        mtp.iter().all(|r| r["drafted"].as_u64().unwrap() > 0),
        "{v}"
    );
    // No block was shown rows that do not fit its positions (it would stop).
    assert!(!err.contains("drafting stops"), "{err}");
    cleanup(&packed);
}

/// `les bench --speculate ngram`: every schedule plain and speculative, side by
/// side, with the same tokens; drafts verified whole are counted.
#[test]
fn bench_speculate_compares_plain_and_speculative_decoding() {
    let m = packed_tiny("speculate");
    let (out, _) = les(&[
        "bench",
        "-m",
        m.to_str().unwrap(),
        "--slots",
        "4",
        "--schedules",
        "resident,les",
        "--speculate",
        "ngram",
        "--ngram-min",
        "1",
        "--draft-fixed",
        "--temp",
        "0",
        "-n",
        "24",
        "--json",
    ]);
    let v: Json = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["identical_tokens"], true);
    assert_eq!(v["speculate"], "ngram");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4);
    let row = |s: &str, spec: bool| {
        runs.iter()
            .find(|r| r["schedule"] == s && r["speculative"] == spec)
            .unwrap_or_else(|| panic!("no {s} row ({spec}): {v}"))
    };
    for s in ["resident", "les"] {
        let (plain, spec) = (row(s, false), row(s, true));
        assert_eq!(plain["speedup"], 1.0);
        assert_eq!(plain["drafted"], 0);
        assert_eq!(plain["tokens_per_pass"], 1.0);
        assert!(spec["drafted"].as_u64().unwrap() > 0, "{spec}");
        assert!(spec["tok_s"].as_f64().unwrap() > 0.0);
        let accepted = spec["accepted"].as_f64().unwrap();
        let tpp = spec["tokens_per_pass"].as_f64().unwrap();
        assert!((tpp - 24.0 / (24.0 - accepted)).abs() < 1e-9, "{spec}");
    }
    assert_eq!(row("resident", true)["bytes_per_token"], 0.0);
    // Bad combinations are usage errors.
    for extra in [&["--sweep", "25"][..], &["--prefill-batches", "1,8"]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_les"))
            .args(["bench", "-m", m.to_str().unwrap(), "--speculate", "ngram"])
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
    }
    cleanup(&m);
}

/// `les bench --speculate mtp` drafts with a qwen35moe model's own nextn
/// block (the bench's unmeasured prompt head included in what it sees).
#[test]
fn bench_speculate_mtp_drafts_with_the_models_block() {
    let packed = packed_tiny_of("qwen35moe", "mtp");
    let q = packed.to_str().unwrap();
    let (out, _) = les(&[
        "bench",
        "-m",
        q,
        "--slots",
        "4",
        "--schedules",
        "les",
        "--speculate",
        "mtp",
        "--draft-fixed",
        "--draft-max",
        "2",
        "--temp",
        "0",
        "-n",
        "16",
        "--json",
    ]);
    let v: Json = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["identical_tokens"], true);
    assert_eq!(v["speculate"], "mtp");
    let runs = v["runs"].as_array().unwrap();
    let spec = runs.iter().find(|r| r["speculative"] == true).unwrap();
    assert!(spec["drafted"].as_u64().unwrap() > 0, "{spec}");
    cleanup(&packed);
}

#[test]
fn bench_reports_the_kernels_prefetch_distance_it_ran_with() {
    let model = packed_tiny("prefetch");
    let bench = |distance: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_les"))
            .env("LES_KERNEL_PREFETCH", distance)
            .args(["bench", "-m"])
            .arg(&model)
            .args(["--slots", "6", "-n", "4", "--prompt", PROMPT, "--json"])
            .output()
            .expect("les runs");
        let err = String::from_utf8(o.stderr).unwrap();
        assert!(o.status.success(), "{err}");
        let j: Json = serde_json::from_slice(&o.stdout).unwrap();
        (j, err)
    };
    let (with, err) = bench("1024");
    assert_eq!(with["kernels"]["prefetch_bytes"], 1024, "{with}");
    assert!(err.contains("(weight prefetch 1024 B)"), "{err}");
    let (without, err) = bench("0");
    assert_eq!(without["kernels"]["prefetch_bytes"], 0, "{without}");
    assert!(err.contains("(no weight prefetch)"), "{err}");
    assert_eq!(with["kernels"]["isa"], without["kernels"]["isa"]);
    // The distance changes no token.
    let toks = |j: &Json, s: &str| tokens(&j["schedules"][s]["tokens"]);
    for s in ["on-demand", "les"] {
        assert_eq!(toks(&with, s), toks(&without, s), "{s}");
    }
    cleanup(&model);
}
