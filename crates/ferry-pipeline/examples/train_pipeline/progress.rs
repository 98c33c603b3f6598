//! Training progress: an `indicatif` bar redrawn in place on a terminal,
//! plus a line every tenth of the run (the only output when stderr is not
//! a terminal, e.g. in CI logs).

use indicatif::{ProgressBar, ProgressStyle};

/// The progress of one training run.
pub(crate) struct Progress {
    bar: ProgressBar,
    steps: usize,
    label: &'static str,
}

impl Progress {
    /// A bar of `steps` steps, its lines prefixed with `label`.
    pub(crate) fn new(label: &'static str, steps: usize) -> Self {
        let bar = ProgressBar::new(steps as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "  {prefix} [{bar:30}] {pos:>4}/{len}  loss {msg:>9}  {per_sec:>14}  eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>."),
        );
        bar.set_prefix(label);
        Self { bar, steps, label }
    }

    /// Step `step` (1-based) ended with `loss`.
    pub(crate) fn step(&self, step: usize, loss: f64) {
        self.bar.set_message(format!("{loss:.5}"));
        self.bar.set_position(step as u64);
        if step == 1 || step % (self.steps / 10).max(1) == 0 || step == self.steps {
            let rate = step as f64 / self.bar.elapsed().as_secs_f64().max(1e-9);
            let line = format!(
                "  {} step {step:>4}/{}  loss {loss:>9.5}  {rate:>6.1} steps/s",
                self.label, self.steps
            );
            if self.bar.is_hidden() {
                eprintln!("{line}");
            } else {
                self.bar.println(line);
            }
        }
    }

    /// Removes the bar.
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
