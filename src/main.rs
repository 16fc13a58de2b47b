//! The `moe-audit` binary: the command line of the library (`moe_audit::command`), which the
//! Python wheel's `moe-audit` runs too.

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(moe_audit::command::main(std::env::args_os()))
}
