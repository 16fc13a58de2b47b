//! Progress bars on stderr for the library's [`Progress`] reports (audit probes, sweep cells,
//! exploit seeds).
//!
//! Bars are drawn only when stderr is a terminal: redirected or captured (CI logs, tests, a
//! pipe) they are hidden, and no output (stdout, JSON, JUnit, files) ever carries them.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use moe_audit::progress::Progress;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};

/// An audit's bar on stderr: `<router> <probe> (i/n)`, then the probe's cases done of planned.
pub(crate) struct AuditBar {
    bar: ProgressBar,
    probes: usize,
    started: AtomicUsize,
}

impl AuditBar {
    /// A bar for `probes` probe runs in all (routers × probes), hidden unless stderr is a
    /// terminal.
    pub(crate) fn stderr(probes: usize) -> AuditBar {
        AuditBar { bar: ProgressBar::hidden(), probes, started: AtomicUsize::new(0) }
    }

    /// Clears the bar.
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Progress for AuditBar {
    fn probe(&self, label: &str) {
        let i = self.started.fetch_add(1, Ordering::Relaxed) + 1;
        // No bar until the probe plans cases (D, S, M and L plan none). Drawn from the first
        // probe on, so no line without its label appears.
        self.bar.set_length(0);
        self.bar.set_position(0);
        self.bar.set_style(ProgressStyle::with_template("{prefix} {elapsed}").expect("valid template"));
        self.bar.set_prefix(format!("{label} ({i}/{})", self.probes));
        if i == 1 && std::io::stderr().is_terminal() {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    }

    fn plan(&self, n: usize) {
        if self.bar.length() == Some(0) {
            let cases = ProgressStyle::with_template("{prefix} {bar:30} {pos}/{len} cases {elapsed}");
            self.bar.set_style(cases.expect("valid template"));
        }
        self.bar.inc_length(n as u64);
    }

    fn done(&self, n: usize) {
        self.bar.inc(n as u64);
    }
}

/// A bar of `len` steps with a message (sweep cells, exploit seeds), hidden unless stderr is a
/// terminal.
pub(crate) fn bar(len: u64) -> ProgressBar {
    let bar = on_terminal(len);
    bar.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"));
    bar
}

fn on_terminal(len: u64) -> ProgressBar {
    if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    }
}
