//! Inline SVG pieces the reports share: token strips, heatmaps, stacked bars and a scatter.
//! Each returns one `<svg>` element sized to its content; every mark carries a `<title>` (a
//! tooltip without script) and the text a reader needs is also in the page's tables.

use super::page::esc;
use std::fmt::Write;

/// One token of a strip.
pub(super) struct Cell {
    /// Position in its call.
    pub(crate) pos: usize,
    /// Short text inside the cell (a token id, or nothing).
    pub(crate) text: String,
    /// Fill colour.
    pub(crate) fill: &'static str,
    /// Tooltip.
    pub(crate) title: String,
    /// The witness token: drawn with a heavy border.
    pub(crate) mark: bool,
}

/// A strip: a label and the cells of one sequence.
pub(super) struct Strip {
    pub(crate) label: String,
    /// The marked token's position (strips are aligned on it).
    pub(crate) focus: usize,
    pub(crate) cells: Vec<Cell>,
}

const CELL: i64 = 24;
const LABEL: i64 = 150;
/// Positions shown before and after the marked token (a long sequence is cut around it).
const BEFORE: i64 = 64;
const AFTER: i64 = 32;

/// Strips one above the other, aligned on their marked tokens.
pub(super) fn strips(strips: &[Strip]) -> String {
    let rel = |s: &Strip, c: &Cell| c.pos as i64 - s.focus as i64;
    let shown = |s: &Strip, c: &Cell| (-BEFORE..AFTER).contains(&rel(s, c));
    let lo = strips.iter().flat_map(|s| s.cells.iter().filter(|c| shown(s, c)).map(|c| rel(s, c))).min().unwrap_or(0);
    let hi = strips.iter().flat_map(|s| s.cells.iter().filter(|c| shown(s, c)).map(|c| rel(s, c))).max().unwrap_or(0);
    let (row, top) = (CELL + 22, 14);
    let width = LABEL + (hi - lo + 1) * CELL + 8;
    let height = top + row * strips.len() as i64;
    let mut out = format!("<svg width=\"{width}\" height=\"{height}\" role=\"img\">");
    for (i, s) in strips.iter().enumerate() {
        let y = top + i as i64 * row;
        let _ = write!(out, "<text x=\"0\" y=\"{}\">{}</text>", y + CELL / 2 + 4, esc(&s.label));
        let cut_before = s.cells.iter().any(|c| rel(s, c) < -BEFORE);
        let cut_after = s.cells.iter().any(|c| rel(s, c) >= AFTER);
        for c in s.cells.iter().filter(|c| shown(s, c)) {
            let x = LABEL + (rel(s, c) - lo) * CELL;
            let stroke = if c.mark { "stroke=\"#1b1f24\" stroke-width=\"3\"" } else { "stroke=\"#afb8c1\"" };
            let _ = write!(
                out,
                "<g><title>{}</title><rect x=\"{x}\" y=\"{y}\" width=\"{}\" height=\"{CELL}\" fill=\"{}\" {stroke}/>",
                esc(&c.title),
                CELL - 2,
                c.fill
            );
            if !c.text.is_empty() {
                let _ = write!(
                    out,
                    "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" style=\"font-size:9px\">{}</text>",
                    x + CELL / 2 - 1,
                    y + CELL / 2 + 3,
                    esc(&c.text)
                );
            }
            out.push_str("</g>");
            if c.pos % 8 == 0 || c.mark {
                let _ = write!(out, "<text x=\"{x}\" y=\"{}\" style=\"font-size:9px\">{}</text>", y + CELL + 11, c.pos);
            }
        }
        let edge = |r: i64| LABEL + (r - lo) * CELL;
        if cut_before {
            let _ = write!(out, "<text x=\"{}\" y=\"{}\">…</text>", edge(-BEFORE) - 12, y + CELL / 2 + 4);
        }
        if cut_after {
            let _ = write!(out, "<text x=\"{}\" y=\"{}\">…</text>", edge(AFTER), y + CELL / 2 + 4);
        }
    }
    out.push_str("</svg>\n");
    out
}

/// `v / max` as a shade of `rgb`, square root so that rare cells stay visible.
fn shade(v: f64, max: f64, rgb: (u8, u8, u8)) -> String {
    let level = if max > 0.0 { (v / max).clamp(0.0, 1.0).sqrt() } else { 0.0 };
    let mix = |c: u8| (255.0 - level * (255.0 - f64::from(c))).round() as u8;
    format!("#{:02x}{:02x}{:02x}", mix(rgb.0), mix(rgb.1), mix(rgb.2))
}

/// A heatmap: one row per label, one column per `span` positions; zero cells stay white.
pub(super) fn heatmap(
    grid: &[Vec<f64>],
    labels: &[String],
    span: usize,
    rgb: (u8, u8, u8),
    title: &dyn Fn(usize, usize, f64) -> String,
) -> String {
    let cols = grid.iter().map(Vec::len).max().unwrap_or(0) as i64;
    let cw = (720 / cols.max(1)).clamp(2, 14);
    let (rh, left, top) = (16, 70, 4);
    let max = grid.iter().flatten().copied().fold(0.0, f64::max);
    let (width, height) = (left + cols * cw + 10, top + rh * grid.len() as i64 + 18);
    let mut out = format!("<svg width=\"{width}\" height=\"{height}\" role=\"img\">");
    let _ = write!(
        out,
        "<rect x=\"{left}\" y=\"{top}\" width=\"{}\" height=\"{}\" fill=\"#fff\" stroke=\"#afb8c1\"/>",
        cols * cw,
        rh * grid.len() as i64
    );
    for (r, row) in grid.iter().enumerate() {
        let y = top + r as i64 * rh;
        let _ = write!(out, "<text x=\"0\" y=\"{}\">{}</text>", y + rh - 4, esc(&labels[r]));
        for (c, &v) in row.iter().enumerate().filter(|(_, v)| **v > 0.0) {
            let _ = write!(
                out,
                "<rect x=\"{}\" y=\"{y}\" width=\"{cw}\" height=\"{rh}\" fill=\"{}\"><title>{}</title></rect>",
                left + c as i64 * cw,
                shade(v, max, rgb),
                esc(&title(r, c, v))
            );
        }
    }
    let step = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024].into_iter().find(|s| s * cw >= 40).unwrap_or(2048);
    let base = top + rh * grid.len() as i64 + 13;
    for c in (0..cols).step_by(step as usize) {
        let _ = write!(
            out,
            "<text x=\"{}\" y=\"{base}\" style=\"font-size:9px\">{}</text>",
            left + c * cw,
            c as usize * span
        );
    }
    out.push_str("</svg>\n");
    out
}

/// One bar of a stacked bar chart: its label and (value, colour, tooltip) segments.
pub(super) struct Bar {
    pub(crate) label: String,
    pub(crate) parts: Vec<(f64, &'static str, String)>,
}

/// Vertical stacked bars on a linear scale from 0 to `max`, ticks written by `tick`.
pub(super) fn bars(bars: &[Bar], max: f64, tick: &dyn Fn(f64) -> String) -> String {
    let (left, top, plot_h) = (56i64, 8i64, 150i64);
    let bw = (760 / (bars.len() as i64).max(1)).clamp(6, 48);
    let width = left + bw * bars.len() as i64 + 10;
    let height = top + plot_h + 40;
    let max = if max > 0.0 { max } else { 1.0 };
    let y = |v: f64| top + plot_h - (v / max * plot_h as f64).round() as i64;
    let mut out = format!("<svg width=\"{width}\" height=\"{height}\" role=\"img\">");
    for i in 0..=4 {
        let v = max * f64::from(i) / 4.0;
        let _ = write!(
            out,
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{yy}\" y2=\"{yy}\" stroke=\"#eaeef2\"/><text x=\"{}\" y=\"{}\" text-anchor=\"end\" style=\"font-size:10px\">{}</text>",
            width - 10,
            left - 4,
            y(v) + 4,
            esc(&tick(v)),
            yy = y(v)
        );
    }
    let every = (bars.len() as i64 * 30 / 760).max(1) as usize;
    for (i, b) in bars.iter().enumerate() {
        let x = left + i as i64 * bw;
        let mut base = 0.0;
        for (v, colour, title) in b.parts.iter().filter(|p| p.0 > 0.0) {
            let (y0, y1) = (y(base), y(base + v));
            let _ = write!(
                out,
                "<rect x=\"{}\" y=\"{y1}\" width=\"{}\" height=\"{}\" fill=\"{colour}\"><title>{}</title></rect>",
                x + 1,
                bw - 2,
                (y0 - y1).max(1),
                esc(title)
            );
            base += v;
        }
        if i % every == 0 {
            let _ = write!(
                out,
                "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" style=\"font-size:10px\">{}</text>",
                x + bw / 2,
                top + plot_h + 14,
                esc(&b.label)
            );
        }
    }
    let _ = writeln!(
        out,
        "<line x1=\"{left}\" x2=\"{}\" y1=\"{b}\" y2=\"{b}\" stroke=\"#57606a\"/></svg>",
        width - 10,
        b = top + plot_h
    );
    out
}

/// A labelled point of a scatter.
pub(super) struct Point {
    pub(crate) x: f64,
    pub(crate) y: f64,
    pub(crate) label: String,
    pub(crate) fill: &'static str,
}

/// A scatter from (1, 0) up, the axes named, each point labelled.
pub(super) fn scatter(points: &[Point], x_name: &str, y_name: &str, y_tick: &dyn Fn(f64) -> String) -> String {
    let (left, top, w, h) = (64i64, 10i64, 720i64, 320i64);
    let x_max = points.iter().map(|p| p.x).fold(1.0, f64::max) * 1.08;
    let y_max = points.iter().map(|p| p.y).fold(0.01, f64::max) * 1.1;
    let px = |x: f64| left + ((x - 1.0).max(0.0) / (x_max - 1.0).max(1e-9) * w as f64).round() as i64;
    let py = |y: f64| top + h - (y / y_max * h as f64).round() as i64;
    let mut out = format!("<svg width=\"{}\" height=\"{}\" role=\"img\">", left + w + 200, top + h + 46);
    let _ =
        write!(out, "<rect x=\"{left}\" y=\"{top}\" width=\"{w}\" height=\"{h}\" fill=\"none\" stroke=\"#8c959f\"/>");
    for i in 0..=4 {
        let (fx, fy) = (1.0 + (x_max - 1.0) * f64::from(i) / 4.0, y_max * f64::from(i) / 4.0);
        let _ = write!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" style=\"font-size:10px\">{fx:.2}</text><text x=\"{}\" y=\"{}\" text-anchor=\"end\" style=\"font-size:10px\">{}</text>",
            px(fx),
            top + h + 14,
            left - 4,
            py(fy) + 4,
            esc(&y_tick(fy))
        );
    }
    let _ = write!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text><text x=\"12\" y=\"{}\" transform=\"rotate(-90 12 {})\" text-anchor=\"middle\">{}</text>",
        left + w / 2,
        top + h + 36,
        esc(x_name),
        top + h / 2,
        top + h / 2,
        esc(y_name)
    );
    for p in points {
        let (x, y) = (px(p.x), py(p.y));
        let _ = write!(
            out,
            "<g><title>{}</title><circle cx=\"{x}\" cy=\"{y}\" r=\"6\" fill=\"{}\" stroke=\"#1b1f24\"/><text x=\"{}\" y=\"{}\">{}</text></g>",
            esc(&p.label),
            p.fill,
            x + 9,
            y - 6,
            esc(&p.label)
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shades_run_from_white_to_the_colour() {
        assert_eq!(shade(0.0, 4.0, (200, 30, 40)), "#ffffff");
        assert_eq!(shade(4.0, 4.0, (200, 30, 40)), "#c81e28");
        assert_eq!(shade(1.0, 0.0, (200, 30, 40)), "#ffffff");
    }

    #[test]
    fn a_long_strip_is_cut_around_its_token() {
        let cell = |pos| Cell { pos, text: String::new(), fill: "#fff", title: String::new(), mark: pos == 300 };
        let s = strips(&[Strip { label: "a".into(), focus: 300, cells: (0..1000).map(cell).collect() }]);
        assert_eq!(s.matches("<rect").count(), (BEFORE + AFTER) as usize);
        assert_eq!(s.matches('…').count(), 2, "{s}");
    }
}
