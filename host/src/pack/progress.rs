//! A one-line progress bar for long byte-counting jobs (bytes done / total,
//! rate, ETA), redrawn in place at most ten times a second.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Least time between two redraws.
const REFRESH: Duration = Duration::from_millis(100);

/// A progress bar on stderr; silent when stderr is not a terminal.
#[derive(Debug)]
pub struct ProgressBar {
    label: String,
    start: Instant,
    last: Option<Instant>,
    enabled: bool,
    drawn: bool,
}

impl ProgressBar {
    /// A bar labelled `label`, drawn only if stderr is a terminal.
    pub fn new(label: &str) -> Self {
        Self::with_enabled(label, Self::stderr_is_terminal())
    }

    /// Whether stderr is a terminal (where a bar redrawn in place makes sense).
    pub fn stderr_is_terminal() -> bool {
        std::io::stderr().is_terminal()
    }

    /// A bar drawn (or not) whatever stderr is.
    pub fn with_enabled(label: &str, enabled: bool) -> Self {
        ProgressBar {
            label: label.into(),
            start: Instant::now(),
            last: None,
            enabled,
            drawn: false,
        }
    }

    /// Records progress; redraws if the last redraw is old enough or the job is done.
    pub fn update(&mut self, done: u64, total: u64) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if done < total && self.last.is_some_and(|t| now - t < REFRESH) {
            return;
        }
        self.last = Some(now);
        let line = render(&self.label, done, total, now - self.start);
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r{line}\x1b[K");
        let _ = err.flush();
        self.drawn = true;
    }

    /// Ends the bar's line (call once the job is over, before printing more).
    pub fn finish(&mut self) {
        if self.drawn {
            note!();
            self.drawn = false;
        }
    }
}

impl Drop for ProgressBar {
    fn drop(&mut self) {
        self.finish();
    }
}

/// `1.5 GiB`, `12.0 MiB`, `512 B`.
pub fn human_bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} {}", UNITS[0])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn clock(secs: f64) -> String {
    let s = secs.round() as u64;
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

/// The bar's text: `label [=====>    ]  42%  1.2 GiB / 3.0 GiB  210.0 MiB/s  ETA 0:09`.
pub fn render(label: &str, done: u64, total: u64, elapsed: Duration) -> String {
    const WIDTH: usize = 30;
    let frac = if total == 0 {
        1.0
    } else {
        (done as f64 / total as f64).clamp(0.0, 1.0)
    };
    let filled = (frac * WIDTH as f64) as usize;
    let mut bar = "=".repeat(filled);
    if filled < WIDTH {
        bar.push('>');
        bar.push_str(&" ".repeat(WIDTH - filled - 1));
    }
    let secs = elapsed.as_secs_f64();
    let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
    let eta = if done >= total {
        format!("in {}", clock(secs))
    } else if rate > 0.0 {
        format!("ETA {}", clock((total - done) as f64 / rate))
    } else {
        "ETA -".into()
    };
    format!(
        "{label} [{bar}] {:>3.0}%  {} / {}  {}/s  {eta}",
        frac * 100.0,
        human_bytes(done as f64),
        human_bytes(total as f64),
        human_bytes(rate)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_rendering() {
        let s = render("packing", 512 << 20, 2048 << 20, Duration::from_secs(2));
        assert!(s.starts_with("packing [=======>"), "{s}");
        assert!(
            s.contains(" 25%  512.0 MiB / 2.0 GiB  256.0 MiB/s  ETA 0:06"),
            "{s}"
        );
        let s = render("packing", 10, 10, Duration::from_secs(3725));
        assert!(s.contains("100%") && s.ends_with("in 1:02:05"), "{s}");
        assert_eq!(human_bytes(100.0), "100 B");
    }
}
