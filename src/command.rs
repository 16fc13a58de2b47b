//! The `moe-audit` command line as a function: parse, run, map errors to exit codes (0 ok,
//! 1 leak, 2 error). The binary (src/main.rs) and the Python wheel's `moe-audit` script
//! (`moe_audit._native.main`) both call [`main`], so they behave alike: the same output, exit
//! codes, panic message and signal handling. Not a library API.

use crate::cli::{exit, flag, run, Cli};
use crate::error::{excerpt_long, one_line, present, with_names};
/// A report as its JSON output (the wheel's in-process `routes compare` prints what the command
/// line does).
pub use crate::render::json;
use crate::runtime;
use clap::Parser;
use std::ffi::OsString;

/// Runs the command line `args` (the first is the program name) and returns its exit code.
/// Call once per process, before any other thread starts (it installs the signal thread); a
/// panic or a signal ends the process as the binary does.
pub fn main(args: impl IntoIterator<Item = OsString>) -> u8 {
    // The last line of defence: a panic anywhere is one line and exit 2, routers killed and no
    // temporary output left.
    std::panic::set_hook(Box::new(|info| {
        let what = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info.location().map_or(String::new(), |l| format!(" at {}:{}", l.file(), l.line()));
        runtime::clean_up();
        runtime::error_line(&format!("error: internal error (a bug, please report it): {}{at}", one_line(&what)));
        std::process::exit(exit::ERROR.into());
    }));
    if let Err(e) = runtime::init() {
        runtime::error_line(&format!("error: {}", present(&e, flag)));
        return exit::ERROR;
    }
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        // --help and --version print and succeed.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return exit::OK;
        }
        // A usage error is one line too, like every other error: clap's first paragraph (with
        // its own `error: ` prefix) joined, and where to look for more.
        Err(e) => {
            let text = e.render().to_string();
            let first: Vec<&str> = text.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
            // The value clap quotes is the caller's, and may be long.
            runtime::error_line(&format!("{} (see --help)", excerpt_long(first.join(" "))));
            return exit::ERROR;
        }
    };
    let mut out = ClosedPipeOk::new(std::io::stdout().lock());
    // What the command prints (reports, errors) names settings as its flags.
    let result = with_names(flag, || run(cli, &mut out));
    // A host process (Python) does not flush Rust's stdout at exit as a Rust `main` does.
    let _ = std::io::Write::flush(&mut out);
    match result {
        Ok(code) => code,
        Err(e) => {
            // The signal thread is ending the process with its own message.
            while runtime::interrupted_by_signal() {
                std::thread::park();
            }
            runtime::error_line(&format!("error: {}", present(&e, flag)));
            exit::ERROR
        }
    }
}

/// Stdout that a reader may close early (`moe-audit presets | head -1`): the rest of the output
/// is dropped quietly, as standard tools do, and the command still ends with its own exit code
/// (a gate's verdict does not depend on who reads it).
struct ClosedPipeOk<W> {
    inner: W,
    closed: bool,
}

impl<W: std::io::Write> ClosedPipeOk<W> {
    fn new(inner: W) -> Self {
        Self { inner, closed: false }
    }

    fn quiet<T>(&mut self, result: std::io::Result<T>, dropped: T) -> std::io::Result<T> {
        match result {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(dropped)
            }
            other => other,
        }
    }
}

impl<W: std::io::Write> std::io::Write for ClosedPipeOk<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.closed {
            return Ok(buf.len());
        }
        let result = self.inner.write(buf);
        self.quiet(result, buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.closed {
            return Ok(());
        }
        let result = self.inner.flush();
        self.quiet(result, ())
    }
}
