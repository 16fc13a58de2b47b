//! The `moe-audit` binary: parse, run, map errors to exit codes (0 ok, 1 leak, 2 error).

use clap::Parser;
use moe_audit::cli::{run, Cli};
use std::process::ExitCode;

fn main() -> ExitCode {
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
            eprintln!("{} (see --help)", first.join(" "));
            return ExitCode::from(2);
        }
    };
    match run(cli, &mut std::io::stdout().lock()) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
