//! The share of CPU time a hypervisor took from this machine ("steal").
//!
//! On a virtual machine whose host emulates the disk on the same physical cores
//! as the virtual CPUs, every byte read costs the guest CPU time it never sees
//! as its own: reads overlapped with compute slow the compute down. `les bench`
//! measures the steal while each schedule decodes, so a ratio measured on such a
//! machine can be read for what it is. Linux only (`/proc/stat`); elsewhere, or
//! where the file cannot be read, there is no measurement.

use std::fs;

/// The CPU time counters of the whole machine (all CPUs), in clock ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTimes {
    /// Every state summed (user, nice, system, idle, iowait, irq, softirq, steal).
    pub total: u64,
    /// Time runnable but not run because the hypervisor ran something else.
    pub steal: u64,
}

impl CpuTimes {
    /// The counters now, from `/proc/stat`.
    pub fn now() -> Option<CpuTimes> {
        parse(&fs::read_to_string("/proc/stat").ok()?)
    }

    /// The share of CPU time stolen between `earlier` and `self`, in 0..=1
    /// (`None` when no time passed).
    pub fn steal_since(&self, earlier: &CpuTimes) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let steal = self.steal.checked_sub(earlier.steal)?;
        (total > 0).then(|| (steal as f64 / total as f64).min(1.0))
    }
}

/// The aggregate `cpu` line of a `/proc/stat` text: `cpu user nice system idle
/// iowait irq softirq steal [guest guest_nice]` (guest time is already counted
/// in user and nice, so it is left out of the total).
fn parse(stat: &str) -> Option<CpuTimes> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    if fields.len() < 8 {
        return None;
    }
    let total = fields.iter().try_fold(0u64, |a, &f| a.checked_add(f))?;
    Some(CpuTimes {
        total,
        steal: fields[7],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_aggregate_line() {
        let stat = "cpu  68290 0 14693 386436 11075 0 432 1943 0 0\n\
                    cpu0 34000 0 7000 193000 5000 0 200 900 0 0\nintr 1 2 3\n";
        let t = parse(stat).unwrap();
        assert_eq!(t.steal, 1943);
        assert_eq!(t.total, 68290 + 14693 + 386436 + 11075 + 432 + 1943);
    }

    #[test]
    fn steal_share_between_two_readings() {
        let a = CpuTimes {
            total: 1000,
            steal: 10,
        };
        let b = CpuTimes {
            total: 1200,
            steal: 40,
        };
        assert_eq!(b.steal_since(&a), Some(0.15));
        assert_eq!(a.steal_since(&a), None, "no time passed");
        assert_eq!(a.steal_since(&b), None, "counters went backwards");
    }

    #[test]
    fn rejects_what_is_not_a_stat_file() {
        assert_eq!(parse(""), None);
        assert_eq!(parse("cpu 1 2 3\n"), None, "too few fields (old kernels)");
        assert_eq!(parse("cpu 1 2 3 4 5 6 7 x\n"), None);
        assert_eq!(parse("cpu0 1 2 3 4 5 6 7 8\n"), None, "no aggregate line");
        let max = u64::MAX;
        assert_eq!(parse(&format!("cpu {max} {max} 0 0 0 0 0 0\n")), None);
    }

    #[test]
    fn reads_this_machine() {
        if std::path::Path::new("/proc/stat").exists() {
            let t = CpuTimes::now().expect("/proc/stat parses");
            assert!(t.total >= t.steal);
        }
    }
}
