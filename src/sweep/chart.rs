//! The two charts, each as SVG and PNG through plotters (pure Rust: text is drawn with ab_glyph
//! from a bundled DejaVu Sans Mono, so no system font libraries are needed).

use super::{CellResult, Heatmap};
use crate::error::{Error, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Once;

const SIZE: (u32, u32) = (1000, 640);
pub(crate) const FONT: &str = "sans-serif";
/// Width of the heatmap's colour scale, right of the plot.
const SCALE_WIDTH: u32 = 110;

pub(crate) fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        plotters::style::register_font(
            FONT,
            FontStyle::Normal,
            include_bytes!("../../assets/fonts/DejaVuSansMono.ttf"),
        )
        .unwrap_or_else(|_| panic!("the bundled font is a valid TrueType file"));
    });
}

/// Draws `draw` into `<dir>/<stem>.svg` and `<dir>/<stem>.png`; returns both paths.
macro_rules! both {
    ($dir:expr, $stem:expr, $draw:ident, $($arg:expr),*) => {{
        register_font();
        let svg = $dir.join(format!("{}.svg", $stem));
        $draw(SVGBackend::new(&svg, SIZE).into_drawing_area(), $($arg),*).map_err(|e| draw_error(&svg, e))?;
        let png = $dir.join(format!("{}.png", $stem));
        $draw(BitMapBackend::new(&png, SIZE).into_drawing_area(), $($arg),*).map_err(|e| draw_error(&png, e))?;
        Ok(vec![svg, png])
    }};
}

fn draw_error(path: &Path, e: impl std::fmt::Debug) -> Error {
    Error::input(path, format!("cannot draw: {e:?}"))
}

type Drawn<DB> = std::result::Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// Leak rate against compute imbalance, one point per cell, the Pareto frontier marked.
pub(super) fn leak_vs_imbalance(cells: &[CellResult], dir: &Path) -> Result<Vec<PathBuf>> {
    both!(dir, "leak-vs-imbalance", scatter, cells)
}

/// The cells no other cell beats on both axes (lower imbalance and lower leak rate), by
/// increasing imbalance.
pub fn pareto(points: &[(f64, f64)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by(|&a, &b| {
        points[a].0.total_cmp(&points[b].0).then(points[a].1.total_cmp(&points[b].1)).then(a.cmp(&b))
    });
    let mut best = f64::INFINITY;
    order
        .into_iter()
        .filter(|&i| {
            let better = points[i].1 < best;
            best = best.min(points[i].1);
            better
        })
        .collect()
}

fn scatter<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, cells: &[CellResult]) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let points: Vec<(f64, f64)> = cells.iter().map(|c| (c.max_over_mean_kept, c.leak_rate * 100.0)).collect();
    let x_max = points.iter().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let y_max = points.iter().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("Leak rate vs load imbalance (one point per configuration)", (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0.9..x_max, -0.02 * y_max..y_max)?;
    chart
        .configure_mesh()
        .x_desc("max/mean expert load after dropping (compute imbalance)")
        .y_desc("leak rate, % of tokens (max of P, F, N, R)")
        .label_style((FONT, 14))
        .draw()?;
    let mut routers: Vec<&str> = cells.iter().map(|c| c.router.as_str()).collect();
    routers.dedup();
    for (i, name) in routers.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mine = points.iter().zip(cells).filter(|(_, c)| c.router == *name).map(|(p, _)| *p);
        chart
            .draw_series(mine.map(|p| Circle::new(p, 5, color.filled())))?
            .label(*name)
            .legend(move |(x, y)| Circle::new((x + 8, y), 5, color.filled()));
    }
    let front: Vec<(f64, f64)> = pareto(&points).into_iter().map(|i| points[i]).collect();
    chart
        .draw_series(LineSeries::new(front.iter().copied(), BLACK.stroke_width(2)))?
        .label("Pareto frontier")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.stroke_width(2)));
    chart.draw_series(front.iter().map(|&p| Circle::new(p, 9, BLACK.stroke_width(2))))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()?;
    root.present()
}

/// The heatmap of the chosen router: position × distance, colour = share of changes that
/// affected the position.
pub(super) fn heatmap(h: &Heatmap, dir: &Path) -> Result<Vec<PathBuf>> {
    both!(dir, format!("heatmap-{}", h.router), heat, h)
}

/// Square root so that rare effects stay visible; white = never, full red = the maximum.
fn shade(v: f64, max: f64) -> RGBColor {
    let level = if max > 0.0 { (v / max).sqrt() } else { 0.0 };
    let fade = (255.0 * (1.0 - level)) as u8;
    RGBColor(255, fade, fade)
}

fn heat<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, h: &Heatmap) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let (plot, scale) = root.split_horizontally(SIZE.0 - SCALE_WIDTH);
    let s = h.seq_len as i32;
    let max = h.rate.iter().flatten().copied().fold(0.0, f64::max);
    let caption = format!(
        "{}: share of changes at t + d that change t's routing (E {}, k {}, cf {}, {} x {})",
        h.router,
        h.experts,
        h.top_k.map_or("-".into(), |k| k.to_string()),
        h.capacity_factor.map_or("-".into(), |f| f.to_string()),
        h.batch,
        h.seq_len,
    );
    let mut chart = ChartBuilder::on(&plot)
        .caption(caption, (FONT, 16))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0..s, 1..s)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("position t of the affected token")
        .y_desc("distance d to the changed token")
        .label_style((FONT, 14))
        .draw()?;
    let cells = h.rate.iter().enumerate().flat_map(|(d, row)| {
        row.iter().enumerate().map(move |(t, &v)| {
            let (t, d) = (t as i32, d as i32 + 1);
            Rectangle::new([(t, d), (t + 1, d + 1)], shade(v, max).filled())
        })
    });
    chart.draw_series(cells)?;
    // Colour scale: ten steps from 0 to the maximum share.
    let steps = 10;
    let mut bar = ChartBuilder::on(&scale)
        .margin_top(60)
        .margin_bottom(64)
        .margin_right(48)
        .y_label_area_size(0)
        .build_cartesian_2d(0..1, 0..steps)?;
    bar.draw_series((0..steps).map(|i| {
        Rectangle::new([(0, i), (1, i + 1)], shade(max * f64::from(i + 1) / f64::from(steps), max).filled())
    }))?;
    bar.draw_series((0..steps).map(|i| Rectangle::new([(0, i), (1, i + 1)], BLACK.stroke_width(1))))?;
    // Labels beside the bar, in the scale area's pixels (the bar spans its top 60 to bottom 64).
    let right = SCALE_WIDTH as i32 - 44;
    scale.draw(&Text::new(format!("{:.0}%", max * 100.0), (right, 56), (FONT, 13).into_font()))?;
    scale.draw(&Text::new("0%", (right, SIZE.1 as i32 - 72), (FONT, 13).into_font()))?;
    root.present()
}

#[cfg(test)]
mod tests {
    use super::pareto;

    #[test]
    fn the_frontier_keeps_points_nothing_beats_on_both_axes() {
        let p = [(1.0, 0.5), (1.2, 0.0), (1.1, 0.6), (2.0, 0.0), (1.0, 0.7), (0.9, 0.9)];
        assert_eq!(pareto(&p), vec![5, 0, 1]);
    }
}
