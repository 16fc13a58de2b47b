//! `routes compare` and `routes show`: text, markdown, JSON, JUnit, GitHub annotations, and the
//! per-layer disagreement chart (SVG or PNG by the file's extension).

use super::chart::{draw_error, Drawn};
use crate::error::{Error, Result};
use crate::files::Staged;
use crate::font::{register_font, FONT};
use crate::names::xml;
use crate::records::{Comparison, Summary};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::fmt::Write;
use std::path::Path;

/// The R3 paper's figures (Ma et al. 2025, Qwen3-30B-A3B, SGLang against Megatron, no replay).
pub(crate) const PAPER_DECISIONS: f64 = 0.10;
/// ... and the share of tokens differing in at least one layer.
pub(crate) const PAPER_TOKENS: f64 = 0.94;

fn pct(x: f64) -> String {
    format!("{:.2}%", 100.0 * x)
}

pub(crate) fn verdict(c: &Comparison) -> String {
    let defects: Vec<&str> = c.diagnoses.iter().filter(|d| d.defect).map(|d| d.kind.name()).collect();
    let over = c.max_disagreement.filter(|&m| c.measures.decisions_differ > m);
    let mut why = Vec::new();
    if !defects.is_empty() {
        why.push(defects.join(", "));
    }
    if let Some(m) = over {
        why.push(format!(
            "{} of decisions differ, over {} {}",
            pct(c.measures.decisions_differ),
            crate::error::Text::from(crate::records::settings::MAX_DISAGREEMENT),
            m
        ));
    }
    if why.is_empty() {
        match c.max_disagreement {
            Some(m) => format!(
                "PASS ({} of decisions differ, within {} {m})",
                pct(c.measures.decisions_differ),
                crate::error::Text::from(crate::records::settings::MAX_DISAGREEMENT)
            ),
            None => format!(
                "PASS (no alignment defect; no {} given)",
                crate::error::Text::from(crate::records::settings::MAX_DISAGREEMENT)
            ),
        }
    } else {
        format!("FAIL ({})", why.join("; "))
    }
}

pub(crate) fn side_line(s: &crate::records::Side) -> String {
    format!(
        "{} {} ({}, {} tokens, {} layers, top-{}{})",
        s.name(),
        s.path,
        s.format.name(),
        s.tokens,
        s.layers.len(),
        s.top_k,
        if s.logits { ", logits" } else { "" }
    )
}

pub(crate) fn margins_line(c: &Comparison) -> Option<String> {
    let m = c.measures.margins.as_ref()?;
    let reading = if m.flips == 0 {
        "no flips".to_string()
    } else if m.median_flip < m.median_all / 10.0 {
        "flips sit at near-ties: numerics, not a different router".to_string()
    } else if m.median_flip >= m.median_all / 2.0 {
        "flips happen at ordinary margins: real routing differences, not numerics".to_string()
    } else {
        "flips at reduced margins: partly near-ties".to_string()
    };
    Some(format!(
        "margins ({} logits): median {:.4} at the {} flips against {:.4} over all decisions; {} of flips are near-ties (< 1/10 of the median): {reading}",
        m.side,
        m.median_flip,
        m.flips,
        m.median_all,
        pct(m.near_ties)
    ))
}

/// The comparison as text.
pub(crate) fn routes_text(c: &Comparison) -> String {
    let m = &c.measures;
    let mut out = String::new();
    let _ = writeln!(out, "{}", side_line(&c.rollout));
    let _ = writeln!(out, "{}", side_line(&c.trainer));
    let shifted = c.alignment.segments.iter().filter(|s| s.offset != 0).count();
    let _ = writeln!(
        out,
        "aligned: {} tokens in {} run(s){}, {} layer pairs",
        c.alignment.tokens,
        c.alignment.segments.len(),
        if shifted > 0 { format!(" ({shifted} shifted)") } else { String::new() },
        c.alignment.layers.len()
    );
    out.push('\n');
    for d in &c.diagnoses {
        let _ = writeln!(out, "{} {}: {}", if d.defect { "DEFECT" } else { "note  " }, d.kind.name(), d.found);
        if !d.change.is_empty() {
            let _ = writeln!(out, "       change: {}", d.change);
        }
    }
    if !c.diagnoses.is_empty() {
        out.push('\n');
    }
    let _ = writeln!(out, "{:<40} {:>10}   R3 paper (Qwen3-30B-A3B, no replay)", "", "measured");
    let _ = writeln!(
        out,
        "{:<40} {:>10}   ~{}",
        "router decisions that differ",
        pct(m.decisions_differ),
        pct(PAPER_DECISIONS)
    );
    let _ = writeln!(
        out,
        "{:<40} {:>10}   {}",
        "tokens that differ in >= 1 layer",
        pct(m.tokens_differ),
        pct(PAPER_TOKENS)
    );
    let _ = writeln!(out, "{:<40} {:>10}", "mean top-k overlap", pct(m.overlap));
    if let Some(f) = m.mean_first_differing {
        let _ = writeln!(out, "{:<40} {:>10.2}", "first differing layer (mean index)", f);
    }
    let _ = writeln!(out, "{:<40} {:>10}", "decisions compared", m.decisions);
    if let Some(line) = margins_line(c) {
        let _ = writeln!(out, "{line}");
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "{:>7} {:>7} {:>9} {:>8} {:>8} {:>13}",
        "trainer", "rollout", "decisions", "differ", "overlap", "first differs"
    );
    for l in &m.layers {
        let _ = writeln!(
            out,
            "{:>7} {:>7} {:>9} {:>8} {:>8} {:>13}",
            l.trainer,
            l.rollout,
            l.decisions,
            pct(l.differ),
            pct(l.overlap),
            l.first_differing
        );
    }
    let _ = writeln!(out, "\n{}", verdict(c));
    out
}

/// The comparison as markdown.
pub(crate) fn routes_markdown(c: &Comparison) -> String {
    let m = &c.measures;
    let mut out = String::from("# Rollout against trainer routing\n\n");
    let _ = writeln!(out, "- {}\n- {}\n", side_line(&c.rollout), side_line(&c.trainer));
    let _ = writeln!(out, "**{}**\n", verdict(c));
    if !c.diagnoses.is_empty() {
        out.push_str("| | diagnosis | found | change |\n|---|---|---|---|\n");
        for d in &c.diagnoses {
            let cell = |s: &str| s.replace('|', "\\|");
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                if d.defect { "defect" } else { "note" },
                d.kind.name(),
                cell(&d.found.to_string()),
                cell(&d.change.to_string())
            );
        }
        out.push('\n');
    }
    out.push_str("| headline | measured | R3 paper |\n|---|---:|---:|\n");
    let _ = writeln!(out, "| router decisions that differ | {} | ~{} |", pct(m.decisions_differ), pct(PAPER_DECISIONS));
    let _ = writeln!(out, "| tokens that differ in ≥ 1 layer | {} | {} |", pct(m.tokens_differ), pct(PAPER_TOKENS));
    let _ = writeln!(out, "| mean top-k overlap | {} | |\n", pct(m.overlap));
    if let Some(line) = margins_line(c) {
        let _ = writeln!(out, "{line}\n");
    }
    out.push_str("| trainer layer | rollout layer | decisions | differ | overlap | first differs |\n|---:|---:|---:|---:|---:|---:|\n");
    for l in &m.layers {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            l.trainer,
            l.rollout,
            l.decisions,
            pct(l.differ),
            pct(l.overlap),
            l.first_differing
        );
    }
    out
}

/// JUnit XML: one test case per defect kind the alignment checks, and one for the threshold.
pub(crate) fn routes_junit(c: &Comparison) -> String {
    use crate::records::DiagnosisKind as K;
    let checks = [K::LayerMapping, K::TokenOffset, K::Packing, K::Aliasing, K::ReplayNotApplied];
    let mut cases = Vec::new();
    for k in checks {
        let found: Vec<String> =
            c.diagnoses.iter().filter(|d| d.defect && d.kind == k).map(|d| d.found.to_string()).collect();
        cases.push((k.name().to_string(), (!found.is_empty()).then(|| found.join("; "))));
    }
    let over = c.max_disagreement.filter(|&m| c.measures.decisions_differ > m);
    cases.push((
        "max disagreement".into(),
        over.map(|m| format!("{} of decisions differ, over {m}", pct(c.measures.decisions_differ))),
    ));
    let failures = cases.iter().filter(|c| c.1.is_some()).count();
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(out, "<testsuites name=\"moe-audit routes\" tests=\"{}\" failures=\"{failures}\">", cases.len());
    let _ = writeln!(
        out,
        "  <testsuite name=\"{} vs {}\" tests=\"{}\" failures=\"{failures}\">",
        xml(&c.rollout.path),
        xml(&c.trainer.path),
        cases.len()
    );
    for (name, failure) in cases {
        match failure {
            None => {
                let _ = writeln!(out, "    <testcase name=\"{}\"/>", xml(&name));
            }
            Some(f) => {
                let _ = writeln!(out, "    <testcase name=\"{}\">", xml(&name));
                let _ = writeln!(out, "      <failure message=\"{}\"/>", xml(&f));
                let _ = writeln!(out, "    </testcase>");
            }
        }
    }
    out.push_str("  </testsuite>\n</testsuites>\n");
    out
}

/// GitHub Actions annotations: an error per defect and for a threshold exceeded, a notice with
/// the headline numbers.
pub(crate) fn routes_github(c: &Comparison) -> String {
    let esc = |s: &str| s.replace('%', "%25").replace('\r', "%0D").replace('\n', "%0A");
    let mut out = String::new();
    for d in c.diagnoses.iter().filter(|d| d.defect) {
        let _ = writeln!(
            out,
            "::error file={},title=moe-audit routes: {}::{}",
            esc(&c.trainer.path),
            d.kind.name(),
            esc(&format!("{} Change: {}", d.found, d.change))
        );
    }
    if let Some(m) = c.max_disagreement.filter(|&m| c.measures.decisions_differ > m) {
        let _ = writeln!(
            out,
            "::error file={},title=moe-audit routes: disagreement::{}",
            esc(&c.trainer.path),
            esc(&format!(
                "{} of router decisions differ, over {} {m}",
                pct(c.measures.decisions_differ),
                crate::error::Text::from(crate::records::settings::MAX_DISAGREEMENT)
            ))
        );
    }
    let _ = writeln!(
        out,
        "::notice title=moe-audit routes::{}",
        esc(&format!(
            "{} of router decisions and {} of tokens differ between rollout and trainer",
            pct(c.measures.decisions_differ),
            pct(c.measures.tokens_differ)
        ))
    );
    out
}

/// A record summarised as text: one line per layer.
pub(crate) fn show_text(s: &Summary) -> String {
    let r = &s.record;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} ({}, {} tokens in {} sequence(s), {} empty; {} layers{}, top-{}, {} experts{})",
        r.path,
        r.format.name(),
        r.tokens,
        s.sequences,
        s.empty_tokens,
        r.layers.len(),
        if r.layers_declared { "" } else { " numbered 0.. (not in the file)" },
        r.top_k,
        s.experts,
        if r.logits { ", logits" } else { "" }
    );
    // What reading inferred, one line each.
    let f = &r.found;
    let _ = writeln!(out, "writer: {}", r.format.name());
    let _ = writeln!(out, "dtype: {}", f.dtype);
    let _ = writeln!(
        out,
        "layers: {}{}",
        if r.layers_declared && f.numbering_declared() { "" } else { "not in the file: " },
        f.numbering
    );
    let causes: Vec<String> = f.padding.iter().map(|(c, n)| format!("{n} {c}")).collect();
    let _ = writeln!(
        out,
        "padding rows: {}{}{}",
        s.empty_tokens,
        if causes.is_empty() { String::new() } else { format!(" ({})", causes.join(", ")) },
        if f.pad_segments > 0 {
            format!(", {} trailing pad segment(s) dropped", f.pad_segments)
        } else {
            String::new()
        }
    );
    let _ = writeln!(out, "missing routes: {}", f.missing);
    let list = |v: &[usize]| crate::records::read::ranges(v);
    if !f.dense_filled.is_empty() {
        let _ = writeln!(out, "dense layers holding placeholders: {} (not compared)", list(&f.dense_filled));
    }
    if !f.zero_layers.is_empty() {
        let _ =
            writeln!(out, "layers holding only zeros: {} (dense, or a capture that never ran)", list(&f.zero_layers));
    }
    if f.wrapped_minus_one > 0 {
        let _ = writeln!(out, "wrapped -1: {} (read as missing)", f.wrapped_minus_one);
    }
    if f.wrapped_ids > 0 {
        let _ = writeln!(out, "ids wrapped negative: {} (unwrapped)", f.wrapped_ids);
    }
    if let Some((n, max)) = f.beyond {
        let _ = writeln!(out, "ids not below the expert count: {n}, up to {max} (physical slots?)");
    }
    for n in &f.notes {
        let _ = writeln!(out, "note: {n}");
    }
    let _ = writeln!(
        out,
        "{:>6} {:>8} {:>9} {:>9} {:>7} {:>8} {:>7}",
        "layer", "tokens", "routes", "max/mean", "cv", "busiest", "unused"
    );
    for l in &s.layers {
        if l.routes == 0 {
            let _ = writeln!(out, "{:>6} {:>8} {:>9}   no routes (dense)", l.layer, l.tokens, l.routes);
            continue;
        }
        let _ = writeln!(
            out,
            "{:>6} {:>8} {:>9} {:>9.3} {:>7.3} {:>8} {:>7}",
            l.layer,
            l.tokens,
            l.routes,
            l.max_over_mean,
            l.cv,
            format!("e{}", l.busiest),
            l.unused
        );
    }
    out
}

/// Draws the per-layer disagreement chart into `path` (`.svg` or `.png`), staged in `staged`.
pub(crate) fn routes_chart(c: &Comparison, path: &Path, staged: &mut Staged) -> Result<()> {
    register_font();
    let tmp = staged.path_for(path);
    const SIZE: (u32, u32) = (1000, 560);
    match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("svg") => draw(SVGBackend::new(&tmp, SIZE).into_drawing_area(), c).map_err(|e| draw_error(path, e)),
        Some("png") => draw(BitMapBackend::new(&tmp, SIZE).into_drawing_area(), c).map_err(|e| draw_error(path, e)),
        _ => Err(Error::input(path, "a chart is .svg or .png")),
    }
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, c: &Comparison) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let layers = &c.measures.layers;
    let top = layers.iter().map(|l| l.differ).fold(0.0f64, f64::max).max(c.max_disagreement.unwrap_or(0.0));
    let y_max = (top * 100.0 * 1.15).max(1.0);
    let n = layers.len().max(1);
    let caption = format!(
        "Router decisions that differ per layer: {} overall, {} of tokens in >= 1 layer",
        pct(c.measures.decisions_differ),
        pct(c.measures.tokens_differ)
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, (FONT, 18))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..n as f64, 0f64..y_max)?;
    let labels: Vec<usize> = layers.iter().map(|l| l.trainer).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("trainer layer")
        .y_desc("% of tokens whose expert set differs")
        .x_labels(n.min(32))
        .x_label_formatter(&|x| labels.get(*x as usize).map_or(String::new(), |l| l.to_string()))
        .label_style((FONT, 13))
        .draw()?;
    let bar = RGBColor(31, 119, 180);
    chart.draw_series(
        layers
            .iter()
            .enumerate()
            .map(|(i, l)| Rectangle::new([(i as f64 + 0.1, 0.0), (i as f64 + 0.9, l.differ * 100.0)], bar.filled())),
    )?;
    if let Some(m) = c.max_disagreement {
        chart.draw_series(LineSeries::new([(0.0, m * 100.0), (n as f64, m * 100.0)], RED.stroke_width(2)))?;
    }
    root.present()?;
    Ok(())
}
