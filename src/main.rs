//! The `moe-audit` binary: parse, run, map errors to exit codes (0 ok, 1 leak, 2 error).

mod cli;
mod runtime;

use clap::Parser;
use cli::{flag, run, Cli};
use runtime::one_line;
use std::process::ExitCode;

fn main() -> ExitCode {
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
        eprintln!("error: internal error (a bug, please report it): {}{at}", one_line(&what));
        std::process::exit(2);
    }));
    // Messages name each setting as the flag that sets it.
    moe_audit::error::name_settings(flag);
    if let Err(e) = runtime::init() {
        eprintln!("error: {}", one_line(&e.to_string()));
        return ExitCode::from(2);
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version print and succeed.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        // A usage error is one line too, like every other error: clap's first paragraph (with
        // its own `error: ` prefix) joined, and where to look for more.
        Err(e) => {
            let text = e.render().to_string();
            let first: Vec<&str> = text.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
            eprintln!("{} (see --help)", one_line(&first.join(" ")));
            return ExitCode::from(2);
        }
    };
    match run(cli, &mut ClosedPipeOk::new(std::io::stdout().lock())) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // The signal thread is ending the process with its own message.
            while runtime::interrupted_by_signal() {
                std::thread::park();
            }
            eprintln!("error: {}", one_line(&e.to_string()));
            ExitCode::from(2)
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
