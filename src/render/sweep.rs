//! A sweep's outputs: `sweep.json` (the whole report), `sweep.csv` (one row per cell), `sweep.md`
//! (the table the README shows) and the charts.

use crate::analyze::Probe;
use crate::error::Result;
use crate::sweep::{leak_column, CellResult, SweepReport};
use std::fmt::Write;

/// Writes every output of a sweep into `dir` (created if needed); returns the paths written.
/// The files are one set: written under temporary names and renamed together, so the folder
/// holds the previous run's set or this one's, never a mix or a torn file.
pub(crate) fn write_sweep(report: &SweepReport, dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
    crate::files::create_dir(dir)?;
    let mut staged = crate::files::Staged::new();
    let mut written = Vec::new();
    let mut write = |name: &str, text: String| -> Result<()> {
        let path = dir.join(name);
        staged.write(&path, text.as_bytes())?;
        written.push(path);
        Ok(())
    };
    write("sweep.json", super::json(report))?;
    write("sweep.csv", csv(&report.cells))?;
    write("sweep.md", markdown(report))?;
    written.extend(super::chart::leak_vs_imbalance(&report.cells, dir, &mut staged)?);
    written.extend(super::chart::heatmap(&report.heatmap, dir, &mut staged)?);
    staged.commit()?;
    Ok(written)
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or(String::new(), |v| v.to_string())
}

/// One header line and one line per cell, both from one list of (column, value) per cell; empty
/// fields where a value does not apply. Fields are quoted by the `csv` crate where they need it
/// (a router name with a comma or a quote).
pub(crate) fn csv(cells: &[CellResult]) -> String {
    // The exploit columns only when the grid measured them: other sweeps keep their bytes.
    let exploit = cells.iter().any(|c| c.exploit.is_some());
    let rows: Vec<_> = cells.iter().map(|c| row(c, exploit)).collect();
    let mut out = csv::Writer::from_writer(Vec::new());
    // Every cell ran the same probes: the first row's names are every row's.
    if let Some(first) = rows.first() {
        out.write_record(first.iter().map(|(name, _)| name)).expect("writing to memory");
    }
    for row in &rows {
        out.write_record(row.iter().map(|(_, value)| value)).expect("writing to memory");
    }
    String::from_utf8(out.into_inner().expect("writing to memory")).expect("UTF-8 fields")
}

/// A cell's CSV fields, each with its column name: the one list the header and the row come from.
fn row(c: &CellResult, exploit: bool) -> Vec<(String, String)> {
    let mut row = Vec::from(named([
        ("router", c.router.clone()),
        ("capacity_factor", opt(c.capacity_factor)),
        ("top_k", opt(c.top_k)),
        ("experts", c.experts.to_string()),
        ("seq_len", c.seq_len.to_string()),
        ("batch", c.batch.to_string()),
        ("balance_steps", c.balance_steps.to_string()),
        ("max_over_mean_load", c.max_over_mean_load.to_string()),
        ("load_cv", c.load_cv.to_string()),
        ("drop_rate", c.drop_rate.to_string()),
        ("aux_loss", c.aux_loss.to_string()),
        ("max_over_mean_kept", c.max_over_mean_kept.to_string()),
    ]));
    row.extend(c.leaks.iter().map(|(p, rate)| (leak_column(*p), opt(*rate))));
    row.extend(named([
        ("leak_rate", c.leak_rate.to_string()),
        ("leaking", c.leaking.clone()),
        ("latent", c.latent.clone()),
        ("mismatch", opt(c.mismatch)),
        ("output_change", opt(c.output_change)),
        ("output_change_affected", opt(c.output_change_affected)),
        ("flips_bf16", opt(c.flips_bf16)),
        ("flips_f16", opt(c.flips_f16)),
    ]));
    if exploit {
        row.extend(named([
            ("exploit_bits", opt(c.exploit.map(|i| i.estimate))),
            ("exploit_half_width", opt(c.exploit.map(|i| i.half_width))),
            ("exploited", opt(c.exploited)),
        ]));
    }
    row
}

/// Fields under fixed column names.
fn named<const N: usize>(fields: [(&'static str, String); N]) -> [(String, String); N] {
    fields.map(|(name, value)| (name.to_string(), value))
}

/// `+0.693 ± 0.048`, in bold when exploited; `–` where not measured.
fn exploit_cell(c: &CellResult) -> String {
    match (c.exploit, c.exploited) {
        (Some(i), Some(true)) => format!("**{:+.3} ± {:.3}**", i.estimate, i.half_width),
        (Some(i), _) => format!("{:+.3} ± {:.3}", i.estimate, i.half_width),
        (None, _) => "–".into(),
    }
}

fn pct(v: f64) -> String {
    format!("{:.1}", v * 100.0)
}

fn opt_pct(v: Option<f64>) -> String {
    v.map_or("–".into(), pct)
}

/// The cells as a markdown table (percentages), then skipped combinations and swamping.
pub(crate) fn markdown(report: &SweepReport) -> String {
    let exploit = report.cells.iter().any(|c| c.exploit.is_some());
    let mut out = String::from(
        "| router | cf | k | E | B×S | max/mean routed | CV | drop % | aux | max/mean kept | P % | F % | N % | R % | L % | M % | Δout % | bf16 flips % |",
    );
    out.push_str(if exploit { " exploit, bits/token below ln V |\n" } else { "\n" });
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    out.push_str(if exploit { "---|\n" } else { "\n" });
    for c in &report.cells {
        let _ = write!(
            out,
            "| {} | {} | {} | {} | {}×{} | {:.3} | {:.3} | {} | {:.3} | {:.3} | {} | {} | {} | {} | {} | {} | {} | {} |",
            crate::names::markdown(&c.router),
            c.capacity_factor.map_or("–".into(), |f| f.to_string()),
            c.top_k.map_or("–".into(), |k| k.to_string()),
            c.experts,
            c.batch,
            c.seq_len,
            c.max_over_mean_load,
            c.load_cv,
            pct(c.drop_rate),
            c.aux_loss,
            c.max_over_mean_kept,
            opt_pct(c.leak(Probe::P)),
            opt_pct(c.leak(Probe::F)),
            opt_pct(c.leak(Probe::N)),
            opt_pct(c.leak(Probe::R)),
            opt_pct(c.leak(Probe::L)),
            opt_pct(c.mismatch),
            opt_pct(c.output_change),
            opt_pct(c.flips_bf16),
        );
        if exploit {
            let _ = write!(out, " {} |", exploit_cell(c));
        }
        out.push('\n');
    }
    for s in &report.skipped {
        let _ = writeln!(out, "\nskipped {}: {}", s.router, s.reason);
    }
    if let Some(rows) = &report.swamping {
        out.push_str("\nAccumulator swamping (probe X): relative error of summing n terms of about 1.\n\n");
        out.push_str("| terms | f16 | bf16 | f32 | f16 pairwise | bf16 pairwise |\n|---|---|---|---|---|---|\n");
        for r in rows {
            let _ = writeln!(
                out,
                "| {} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.2e} |",
                r.terms, r.f16, r.bf16, r.f32, r.f16_pairwise, r.bf16_pairwise
            );
        }
    }
    out
}
