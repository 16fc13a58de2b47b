//! The `moe-audit` binary: parse, run, map errors to exit codes (0 ok, 1 leak, 2 error).

use clap::Parser;
use moe_audit::cli::{run, Cli};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli, &mut std::io::stdout().lock()) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
