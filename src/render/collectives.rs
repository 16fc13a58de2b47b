//! `moe-audit collectives`: the report, its tables (one per dynamic range) and the
//! error-against-ranks charts (SVG and PNG, one per range).

use super::chart::{draw_error, Drawn};
use crate::error::Result;
use crate::font::{register_font, FONT};
use crate::parallel::reduce::Precision;
use crate::parallel::swamping::{AuditPlan, CollectivesReport, Figures};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// The tables: per dynamic range (headed by it when the payload is `seeded`), one row per
/// configuration of `plan` with its error at every rank count of `ranks`; then the `--max-bias`
/// line.
pub(crate) fn render_collectives(r: &CollectivesReport, plan: &AuditPlan, ranks: &[usize], seeded: bool) -> String {
    let last = *ranks.last().expect("not empty");
    let list = ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let mut s = format!(
        "collectives: {} payload, {} elements, ranks {list}; error against the exact sum of the wire inputs; swamped = |error| > {} × |exact|\n",
        r.payload, r.elements, r.tolerance
    );
    for &range in &plan.ranges {
        if seeded {
            s += &format!("\ndynamic range {range}\n");
        }
        s += &format!(
            "{:<13}{:<5}{:<5}| {:>40} | {:>7} | {:>9} | {:>10} | {:>10}\n",
            "algorithm",
            "wire",
            "acc",
            format!("relative error at R = {list}"),
            "growth",
            format!("swamped@{last}"),
            format!("bias@{last}"),
            "bytes/2B(R-1)/R"
        );
        for p in &plan.plans {
            let mine: Vec<&Figures> = r
                .results
                .iter()
                .filter(|f| {
                    f.range == range && (f.algorithm, f.wire, f.accumulate) == (p.algorithm, p.wire, p.accumulate)
                })
                .collect();
            let (Some(first), Some(end)) = (mine.first(), mine.last()) else { continue };
            let errors: Vec<String> = mine.iter().map(|f| format!("{:.1e}", f.relative_error)).collect();
            let growth = if first.relative_error > 0.0 {
                format!("{:.1}x", end.relative_error / first.relative_error)
            } else {
                "-".into()
            };
            s += &format!(
                "{:<13}{:<5}{:<5}| {:>40} | {:>7} | {:>8.2}% | {:>10.1e} | {:>10.3}\n",
                p.algorithm.name(),
                p.wire.name(),
                p.accumulate.name(),
                errors.join(" "),
                growth,
                end.swamped_share * 100.0,
                end.bias,
                end.max_bytes_sent as f64 / end.formula_bytes.max(1.0)
            );
        }
    }
    if let Some(max) = r.max_bias {
        if r.over_max_bias.is_empty() {
            s += &format!(
                "\nevery configuration's |bias| is within {} {max}\n",
                crate::error::Text::from(crate::parallel::settings::MAX_BIAS)
            );
        } else {
            s += &format!(
                "\n|bias| over {} {max}: {}\n",
                crate::error::Text::from(crate::parallel::settings::MAX_BIAS),
                r.over_max_bias.join("; ")
            );
        }
    }
    s
}

/// Relative error against ranks (log-log), one line per configuration, for one range:
/// `<dir>/collectives-range-<range>.svg` and `.png`.
pub(crate) fn collectives_chart(r: &CollectivesReport, plan: &AuditPlan, range: f64, dir: &Path) -> Result<()> {
    register_font();
    let stem = format!("collectives-range-{range}");
    let svg = dir.join(format!("{stem}.svg"));
    draw(SVGBackend::new(&svg, SIZE).into_drawing_area(), r, plan, range).map_err(|e| draw_error(&svg, e))?;
    let png = dir.join(format!("{stem}.png"));
    draw(BitMapBackend::new(&png, SIZE).into_drawing_area(), r, plan, range).map_err(|e| draw_error(&png, e))?;
    Ok(())
}

const SIZE: (u32, u32) = (1200, 760);
/// Errors below this (exact sums) are drawn at it: a log axis has no zero.
const FLOOR: f64 = 1e-9;

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    r: &CollectivesReport,
    plan: &AuditPlan,
    range: f64,
) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let mine: Vec<&Figures> = r.results.iter().filter(|f| f.range == range).collect();
    let err = |f: &Figures| if f.relative_error.is_finite() { f.relative_error.max(FLOOR) } else { 1.0 };
    let x_min = mine.iter().map(|f| f.ranks as f64).fold(f64::INFINITY, f64::min).min(1e9);
    let x_max = mine.iter().map(|f| f.ranks as f64).fold(1.0, f64::max);
    let y_max = mine.iter().map(|f| err(f)).fold(FLOOR * 10.0, f64::max) * 3.0;
    let caption = format!("All-reduce relative error vs ranks (dynamic range {range}, {} elements)", r.elements);
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, (FONT, 20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .right_y_label_area_size(0)
        .build_cartesian_2d((x_min * 0.9..x_max * 1.1).log_scale(), (FLOOR * 0.5..y_max).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("ranks R")
        .y_desc("relative error ||result - exact|| / ||exact||")
        .y_label_formatter(&|v| format!("{v:.0e}"))
        .label_style((FONT, 13))
        .draw()?;
    for (i, p) in plan.plans.iter().enumerate() {
        let points: Vec<(f64, f64)> = mine
            .iter()
            .filter(|f| (f.algorithm, f.wire, f.accumulate) == (p.algorithm, p.wire, p.accumulate))
            .map(|f| (f.ranks as f64, err(f)))
            .collect();
        let color = Palette99::pick(i).to_rgba();
        let style = if p.wire == Precision::F32 { color.stroke_width(1) } else { color.stroke_width(2) };
        let name = format!("{} {}/{}", p.algorithm.name(), p.wire.name(), p.accumulate.name());
        chart
            .draw_series(LineSeries::new(points.iter().copied(), style))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|&q| Circle::new(q, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 11))
        .draw()?;
    root.present()
}
