//! `moe-audit sweep`: the grid of routers × sizes, load balance against leaks, with charts.

use super::bars::bar as progress_bar;
use super::common::MemoryArgs;
use super::exit;
use super::io_error;
use clap::Args;
use moe_audit::error::Result;
use moe_audit::sweep::{self, Grid};
use moe_audit::MemoryBudget;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `moe-audit sweep`.
#[derive(Debug, Args)]
pub(crate) struct SweepArgs {
    /// Grid file (TOML); without it, the built-in default grid.
    #[arg(value_name = "SWEEP.toml")]
    pub(crate) grid: Option<PathBuf>,
    /// Where sweep.json, sweep.csv, sweep.md and the charts go.
    #[arg(long, value_name = "DIR", default_value = "sweep-results")]
    pub(crate) output_dir: PathBuf,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

/// A validated `sweep`: the grid read, where its files go.
#[derive(Debug)]
pub(crate) struct SweepOptions {
    grid: Grid,
    /// How messages name the grid: its file, or `<default grid>`.
    source: String,
    /// The directory the grid's router files are relative to.
    base: PathBuf,
    output_dir: PathBuf,
    budget: MemoryBudget,
}

impl SweepArgs {
    /// The grid file read (or the default grid).
    pub(crate) fn validated(&self) -> Result<SweepOptions> {
        let (grid, source, base) = match &self.grid {
            Some(path) => {
                let base = path.parent().unwrap_or(Path::new(".")).to_path_buf();
                (Grid::from_file(path)?, path.display().to_string(), base)
            }
            None => (Grid::default(), "<default grid>".to_string(), PathBuf::from(".")),
        };
        Ok(SweepOptions { grid, source, base, output_dir: self.output_dir.clone(), budget: self.memory.budget() })
    }
}

pub(super) fn run(s: SweepOptions, out: &mut dyn Write) -> Result<u8> {
    let bar = progress_bar(sweep::cell_count(&s.grid, &s.source, &s.base)? as u64);
    let report = sweep::run(&s.grid, &s.source, &s.base, s.budget, &mut |router| {
        bar.set_message(router.to_string());
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    let written = moe_audit::render::write_sweep(&report, &s.output_dir)?;
    let mut text = moe_audit::render::sweep_markdown(&report);
    text.push('\n');
    for path in written {
        text.push_str(&format!("wrote {}\n", path.display()));
    }
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(exit::OK)
}
