//! The two charts, each as SVG and PNG through plotters (pure Rust: text is drawn with ab_glyph
//! from a bundled DejaVu Sans Mono, so no system font libraries are needed).

use crate::error::{Error, Result};
use crate::files::Staged;
use crate::font::{register_font, FONT};
use crate::sweep::{CellResult, Family, Heatmap};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

const SIZE: (u32, u32) = (1000, 640);
/// The scatter chart is wider: its legend has a panel of its own.
const SCATTER_SIZE: (u32, u32) = (1240, 700);
const LEGEND_WIDTH: u32 = 240;
/// Width of the heatmap's colour scale, right of the plot.
const SCALE_WIDTH: u32 = 110;

/// Draws `draw` into `<dir>/<stem>.svg` and `<dir>/<stem>.png` (staged: temporary files until
/// the set is committed); returns both paths.
macro_rules! both {
    ($dir:expr, $staged:expr, $stem:expr, $size:expr, $draw:ident, $($arg:expr),*) => {{
        register_font();
        let svg = $dir.join(format!("{}.svg", $stem));
        let tmp = $staged.path_for(&svg);
        $draw(SVGBackend::new(&tmp, $size).into_drawing_area(), $($arg),*).map_err(|e| draw_error(&svg, e))?;
        let png = $dir.join(format!("{}.png", $stem));
        let tmp = $staged.path_for(&png);
        $draw(BitMapBackend::new(&tmp, $size).into_drawing_area(), $($arg),*).map_err(|e| draw_error(&png, e))?;
        Ok(vec![svg, png])
    }};
}

/// A plotters failure as an error naming the file being drawn.
pub(super) fn draw_error(path: &Path, e: impl std::fmt::Debug) -> Error {
    Error::input(path, format!("cannot draw: {e:?}"))
}

/// What a drawing function returns.
pub(super) type Drawn<DB> = std::result::Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// Leak rate against compute imbalance, one point per cell, the Pareto frontier marked.
pub(super) fn leak_vs_imbalance(cells: &[CellResult], dir: &Path, staged: &mut Staged) -> Result<Vec<PathBuf>> {
    both!(dir, staged, "leak-vs-imbalance", SCATTER_SIZE, scatter, cells)
}

/// The cells no other cell beats on both axes (lower imbalance and lower leak rate), by
/// increasing imbalance.
pub(crate) fn pareto(points: &[(f64, f64)]) -> Vec<usize> {
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

/// Colours far enough apart to tell routers of one family apart (Tableau 10, then darker hues).
const COLOURS: [RGBColor; 16] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(57, 59, 121),
    RGBColor(99, 121, 57),
    RGBColor(140, 109, 49),
    RGBColor(132, 60, 57),
    RGBColor(123, 65, 115),
    RGBColor(0, 0, 0),
];

/// Draws the marker of a family on `$area` at `$at`, `$offset` pixels from it (a macro: each
/// shape is its own element type, and plotters' dynamic elements only draw on `'static` backends).
macro_rules! draw_marker {
    ($area:expr, $family:expr, $at:expr, $offset:expr, $colour:expr) => {{
        let (x, y): (i32, i32) = $offset;
        let colour: RGBColor = $colour;
        let anchor = EmptyElement::at($at);
        match $family {
            Family::Dropless => $area.draw(&(anchor + Circle::new((x, y), 6, colour.filled()))),
            Family::SequenceCapacity => $area.draw(&(anchor + TriangleMarker::new((x, y), 7, colour.filled()))),
            Family::BatchCapacity => {
                $area.draw(&(anchor + Rectangle::new([(x - 5, y - 5), (x + 5, y + 5)], colour.filled())))
            }
            Family::Balanced => $area.draw(&(anchor + Cross::new((x, y), 6, colour.stroke_width(3)))),
            Family::ExpertChoice => $area
                .draw(&(anchor + Polygon::new(vec![(x, y - 7), (x + 7, y), (x, y + 7), (x - 7, y)], colour.filled()))),
            // A hollow diamond: expert choice's shape, made causal.
            Family::ExpertThreshold => $area.draw(
                &(anchor + Polygon::new(vec![(x, y - 7), (x + 7, y), (x, y + 7), (x - 7, y)], colour.stroke_width(2))),
            ),
        }
    }};
}

/// Pixel offsets that spread points drawn within a few pixels of each other around their shared
/// position (deterministic: by cell order), so no point hides another.
fn spread(pixels: &[(i32, i32)]) -> Vec<(i32, i32)> {
    const NEAR: i32 = 6;
    const RADIUS: f64 = 9.0;
    let mut group_of = vec![usize::MAX; pixels.len()];
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, p) in pixels.iter().enumerate() {
        let near = groups.iter().position(|g| {
            let q = pixels[g[0]];
            (p.0 - q.0).abs() <= NEAR && (p.1 - q.1).abs() <= NEAR
        });
        let g = near.unwrap_or_else(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(i);
        group_of[i] = g;
    }
    let mut offsets = vec![(0, 0); pixels.len()];
    for g in groups.iter().filter(|g| g.len() > 1) {
        for (j, &i) in g.iter().enumerate() {
            let angle = std::f64::consts::TAU * j as f64 / g.len() as f64 - std::f64::consts::FRAC_PI_2;
            offsets[i] = ((RADIUS * angle.cos()).round() as i32, (RADIUS * angle.sin()).round() as i32);
        }
    }
    offsets
}

fn cell_label(c: &CellResult) -> String {
    let mut label = c.router.clone();
    if let Some(cf) = c.capacity_factor {
        label += &format!(" cf {cf}");
    }
    if let Some(k) = c.top_k {
        label += &format!(" k {k}");
    }
    label
}

fn scatter<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, cells: &[CellResult]) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let (plot, legend) = root.split_horizontally(SCATTER_SIZE.0 - LEGEND_WIDTH);
    let points: Vec<(f64, f64)> = cells.iter().map(|c| (c.max_over_mean_kept, c.leak_rate * 100.0)).collect();
    let x_max = points.iter().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let y_max = points.iter().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&plot)
        .caption("Leak rate vs load imbalance (one point per configuration)", (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0.9..x_max, -0.04 * y_max..y_max)?;
    chart
        .configure_mesh()
        .x_desc("max/mean expert load after dropping (compute imbalance)")
        .y_desc("leak rate, % of tokens (max of P, F, N, R)")
        .label_style((FONT, 14))
        .draw()?;
    let routers = router_order(cells);
    let colour = |name: &str| COLOURS[routers.iter().position(|(r, _)| r == name).unwrap_or(0) % COLOURS.len()];
    let offsets = spread(&points.iter().map(|p| chart.backend_coord(p)).collect::<Vec<_>>());
    let front = pareto(&points);
    let front_points: Vec<(f64, f64)> = front.iter().map(|&i| points[i]).collect();
    chart.draw_series(LineSeries::new(front_points.iter().copied(), BLACK.stroke_width(2)))?;
    // A thin line from a spread marker to the value it stands for.
    chart.draw_series(points.iter().zip(&offsets).filter(|(_, o)| **o != (0, 0)).map(|(&p, &(x, y))| {
        EmptyElement::at(p) + PathElement::new(vec![(0, 0), (x, y)], BLACK.mix(0.4).stroke_width(1))
    }))?;
    let area = chart.plotting_area();
    for ((c, &p), &o) in cells.iter().zip(&points).zip(&offsets) {
        draw_marker!(area, c.family, p, o, colour(&c.router))?;
    }
    chart.draw_series(front.iter().map(|&i| {
        let (x, y) = offsets[i];
        EmptyElement::at(points[i])
            + Circle::new((x, y), 11, BLACK.stroke_width(2))
            + Text::new(cell_label(&cells[i]), (x + 14, y - 20), (FONT, 13).into_font())
    }))?;
    draw_legend(&legend, &routers, &colour)?;
    root.present()
}

/// Routers in legend order: by family, then in the order the grid names them.
fn router_order(cells: &[CellResult]) -> Vec<(String, Family)> {
    let mut routers: Vec<(String, Family)> = Vec::new();
    for c in cells {
        if !routers.iter().any(|(r, _)| *r == c.router) {
            routers.push((c.router.clone(), c.family));
        }
    }
    routers.sort_by_key(|(_, f)| *f);
    routers
}

/// The legend in its own panel (so it never covers a point): marker shape per family, colour
/// per router, the Pareto frontier's mark.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    routers: &[(String, Family)],
    colour: &dyn Fn(&str) -> RGBColor,
) -> Drawn<DB> {
    let text = |s: &str, x: i32, y: i32, size: u32| Text::new(s.to_string(), (x, y), (FONT, size).into_font());
    let mut y = 60;
    let mut family = None;
    for (name, f) in routers {
        if family != Some(*f) {
            y += 8;
            area.draw(&text(f.label(), 4, y, 13))?;
            y += 20;
            family = Some(*f);
        }
        draw_marker!(area, *f, (20, y + 7), (0, 0), colour(name))?;
        area.draw(&text(name, 36, y, 13))?;
        y += 20;
    }
    y += 12;
    area.draw(&(EmptyElement::at((20, y + 7)) + Circle::new((0, 0), 11, BLACK.stroke_width(2))))?;
    area.draw(&text("Pareto frontier", 36, y, 13))?;
    area.draw(&text("(labelled: router, cf, k)", 36, y + 18, 12))?;
    Ok(())
}

/// The heatmap of the chosen router: position × distance, colour = share of changes that
/// affected the position.
pub(super) fn heatmap(h: &Heatmap, dir: &Path, staged: &mut Staged) -> Result<Vec<PathBuf>> {
    both!(dir, staged, format!("heatmap-{}", crate::names::file_stem(&h.router)), SIZE, heat, h)
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
    // Colour scale: the shade is the square root of the share, so the bar is drawn evenly in
    // shade and its ticks name the share each shade stands for.
    let steps = 40;
    let mut bar = ChartBuilder::on(&scale)
        .margin_top(60)
        .margin_bottom(64)
        .margin_right(56)
        .y_label_area_size(0)
        .build_cartesian_2d(0.0..1.0, 0.0..1.0)?;
    bar.draw_series((0..steps).map(|i| {
        let (lo, hi) = (f64::from(i) / f64::from(steps), f64::from(i + 1) / f64::from(steps));
        Rectangle::new([(0.0, lo), (1.0, hi)], shade(max * hi * hi, max).filled())
    }))?;
    bar.draw_series(std::iter::once(Rectangle::new([(0.0, 0.0), (1.0, 1.0)], BLACK.stroke_width(1))))?;
    bar.draw_series((0..=5).map(|i| {
        let level = f64::from(i) / 5.0;
        EmptyElement::at((1.0, level))
            + PathElement::new(vec![(0, 0), (5, 0)], BLACK.stroke_width(1))
            + Text::new(format!("{:.1}%", 100.0 * max * level * level), (8, -6), (FONT, 12).into_font())
    }))?;
    root.present()
}

#[cfg(test)]
mod tests {
    use super::{pareto, spread, Family};
    use crate::RouterConfig;

    #[test]
    fn points_drawn_on_top_of_each_other_are_spread_apart() {
        let offsets = spread(&[(100, 100), (102, 99), (300, 50), (100, 101)]);
        assert_eq!(offsets[2], (0, 0), "a lone point stays where it is");
        let near = [offsets[0], offsets[1], offsets[3]];
        for (i, a) in near.iter().enumerate() {
            assert!(near[i + 1..].iter().all(|b| (a.0 - b.0).abs() + (a.1 - b.1).abs() >= 8), "{near:?}");
        }
    }

    #[test]
    fn every_design_family_has_its_preset() {
        let family = |name: &str| Family::of(&RouterConfig::load(name).unwrap());
        assert_eq!(family("mixtral"), Family::Dropless);
        assert_eq!(family("switch"), Family::SequenceCapacity);
        assert_eq!(family("causal-capacity"), Family::SequenceCapacity);
        assert_eq!(family("megatron-probs"), Family::BatchCapacity);
        assert_eq!(family("sinkhorn"), Family::Balanced);
        assert_eq!(family("expert-choice-tc-serve"), Family::ExpertChoice);
    }

    #[test]
    fn the_frontier_keeps_points_nothing_beats_on_both_axes() {
        let p = [(1.0, 0.5), (1.2, 0.0), (1.1, 0.6), (2.0, 0.0), (1.0, 0.7), (0.9, 0.9)];
        assert_eq!(pareto(&p), vec![5, 0, 1]);
    }
}
