//! `moe-audit sweep`: the grid of routers × sizes, load balance against leaks, with charts.

use super::bars::bar as progress_bar;
use super::common::MemoryArgs;
use super::exit;
use super::io_error;
use clap::Args;
use moe_audit::error::Result;
use moe_audit::sweep::{self, Grid};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `moe-audit sweep`.
#[derive(Debug, Args)]
pub struct SweepArgs {
    /// Grid file (TOML); without it, the built-in default grid.
    #[arg(value_name = "SWEEP.toml")]
    pub grid: Option<PathBuf>,
    /// Where sweep.json, sweep.csv, sweep.md and the charts go.
    #[arg(long, value_name = "DIR", default_value = "sweep-results")]
    pub output_dir: PathBuf,
    /// The memory limit.
    #[command(flatten)]
    pub memory: MemoryArgs,
}

pub(super) fn run(args: &SweepArgs, out: &mut dyn Write) -> Result<u8> {
    let (grid, source, base) = match &args.grid {
        Some(path) => {
            (Grid::from_file(path)?, path.display().to_string(), path.parent().unwrap_or(Path::new(".")).to_path_buf())
        }
        None => (Grid::default(), "<default grid>".to_string(), PathBuf::from(".")),
    };
    let bar = progress_bar(sweep::cell_count(&grid, &source, &base)? as u64);
    let report = sweep::run(&grid, &source, &base, args.memory.budget(), &mut |router| {
        bar.set_message(router.to_string());
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    let written = moe_audit::render::write_sweep(&report, &args.output_dir)?;
    let mut text = moe_audit::render::sweep_markdown(&report);
    text.push('\n');
    for path in written {
        text.push_str(&format!("wrote {}\n", path.display()));
    }
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(exit::OK)
}
