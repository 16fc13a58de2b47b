//! A records comparison as a page: the diagnoses first with their evidence (which layer is
//! paired with which, which runs of tokens were shifted), the headline numbers, the
//! disagreement per layer, then per-token lanes of flips with their margins, near-ties told
//! from real flips.

use super::page::{badge, esc, legend, page, pct, table};
use super::svg::{bars, Bar};
use crate::records::{Comparison, Flip, Lane};
use crate::render::routes::{side_line, verdict, PAPER_DECISIONS, PAPER_TOKENS};
use std::fmt::Write;

/// Evidence rows shown before "and N more".
const ROWS: usize = 40;

/// The comparison as one HTML document.
pub(crate) fn routes_html(c: &Comparison) -> String {
    let mut b = String::from("<h1>moe-audit routes compare</h1>\n");
    let _ = writeln!(b, "<p class=\"sub\">{}<br>{}</p>", esc(&side_line(&c.rollout)), esc(&side_line(&c.trainer)));
    let _ = writeln!(b, "<div class=\"summary {}\">{}</div>", if c.failed { "leak" } else { "pass" }, esc(&verdict(c)));
    b.push_str(&routes_sections(c));
    page(&format!("moe-audit routes compare: {} vs {}", c.rollout.path, c.trainer.path), &b)
}

/// The comparison's sections (diagnoses, headline, layers, lanes), for a page of its own or
/// one section of an engine audit's.
pub(super) fn routes_sections(c: &Comparison) -> String {
    let mut b = String::new();
    diagnoses(&mut b, c);
    headline(&mut b, c);
    layers(&mut b, c);
    lanes(&mut b, c);
    b
}

fn diagnoses(b: &mut String, c: &Comparison) {
    b.push_str("<h2>Diagnoses</h2>\n");
    if c.diagnoses.is_empty() {
        b.push_str("<p>No alignment defect: layers and tokens pair as declared.</p>\n");
    }
    for d in &c.diagnoses {
        let word = if d.defect { badge("leak", "DEFECT") } else { badge("na", "note") };
        let _ = write!(b, "<div class=\"card\">{word} <b>{}</b>: {}", esc(d.kind.name()), esc(&d.found.to_string()));
        if !d.change.is_empty() {
            let _ = write!(b, "<div class=\"details\"><b>change:</b> {}</div>", esc(&d.change.to_string()));
        }
        b.push_str("</div>\n");
    }
    let al = &c.alignment;
    b.push_str("<h3>Evidence: which layer is compared with which</h3>\n");
    let rows = al.layers.iter().map(|l| {
        let moved = if l.rollout == l.trainer { String::new() } else { badge("drift", "renumbered") };
        vec![format!("={}", l.rollout), format!("={}", l.trainer), moved]
    });
    table(b, &["rollout layer", "trainer layer", ""], rows);
    let shifted = al.segments.iter().filter(|s| s.offset != 0).count();
    let _ = writeln!(
        b,
        "<h3>Evidence: aligned runs of tokens</h3>\n<p>{} tokens in {} run(s), {shifted} shifted from the declared pairing.</p>",
        al.tokens,
        al.segments.len()
    );
    // Shifted runs first: they are what a diagnosis points at.
    let mut runs: Vec<_> = al.segments.iter().collect();
    runs.sort_by_key(|s| (s.offset == 0, s.sequence, s.rollout));
    let rows = runs.iter().take(ROWS).map(|s| {
        let shift = if s.offset == 0 { "=0".to_string() } else { format!("={} {}", s.offset, badge("drift", "shift")) };
        vec![
            format!("={}", s.sequence),
            format!("={}", s.rollout),
            format!("={}", s.trainer),
            format!("={}", s.len),
            shift,
        ]
    });
    table(b, &["sequence", "rollout row", "trainer row", "tokens", "shift"], rows);
    if runs.len() > ROWS {
        let _ = writeln!(b, "<p class=\"sub\">and {} more run(s)</p>", runs.len() - ROWS);
    }
}

fn headline(b: &mut String, c: &Comparison) {
    let m = &c.measures;
    b.push_str("<h2>Disagreement</h2>\n");
    let mut rows = vec![
        vec![
            "router decisions that differ".into(),
            format!("={}", pct(m.decisions_differ, 2)),
            format!("=~{}", pct(PAPER_DECISIONS, 2)),
        ],
        vec![
            "tokens that differ in ≥ 1 layer".into(),
            format!("={}", pct(m.tokens_differ, 2)),
            format!("={}", pct(PAPER_TOKENS, 2)),
        ],
        vec!["mean top-k overlap".into(), format!("={}", pct(m.overlap, 2)), String::new()],
        vec!["decisions compared".into(), format!("={}", m.decisions), String::new()],
    ];
    if let Some(f) = m.mean_first_differing {
        rows.push(vec!["first differing layer (mean index)".into(), format!("={f:.2}"), String::new()]);
    }
    table(b, &["", "measured", "R3 paper (Qwen3-30B-A3B, no replay)"], rows);
    if let Some(line) = crate::render::routes::margins_line(c) {
        let _ = writeln!(b, "<p>{}</p>", esc(&line));
    }
}

fn layers(b: &mut String, c: &Comparison) {
    let m = &c.measures;
    b.push_str("<h3>Per layer (trainer order)</h3><div class=\"scroll\">");
    let items: Vec<Bar> = m
        .layers
        .iter()
        .map(|l| Bar {
            label: l.trainer.to_string(),
            parts: vec![(l.differ, "#cf222e", format!("trainer layer {}: {} differ", l.trainer, pct(l.differ, 2)))],
        })
        .collect();
    let max = m.layers.iter().map(|l| l.differ).fold(0.0, f64::max);
    b.push_str(&bars(&items, max, &|v| pct(v, 1)));
    b.push_str("</div>");
    let rows = m.layers.iter().map(|l| {
        vec![
            format!("={}", l.trainer),
            format!("={}", l.rollout),
            format!("={}", l.decisions),
            format!("={}", pct(l.differ, 2)),
            format!("={}", pct(l.overlap, 2)),
            format!("={}", l.first_differing),
        ]
    });
    table(b, &["trainer", "rollout", "decisions", "differ", "overlap", "first differs"], rows);
}

/// A flip's kind: a near-tie (margin under a tenth of the median margin, as the margins line
/// counts them), a real flip, or unknown without logits.
fn kind(f: &Flip, threshold: Option<f64>) -> (&'static str, &'static str) {
    match (f.margin, threshold) {
        (Some(m), Some(t)) if f64::from(m) < t => ("near-tie", "#d4a72c"),
        (Some(_), Some(_)) => ("real flip", "#cf222e"),
        _ => ("flip (no logits)", "#8250df"),
    }
}

fn ids(e: &[i32]) -> String {
    e.iter().map(i32::to_string).collect::<Vec<_>>().join(" ")
}

fn lanes(b: &mut String, c: &Comparison) {
    let m = &c.measures;
    let _ = writeln!(b, "<h2>Flips per token</h2>");
    if m.lanes.is_empty() {
        b.push_str("<p>No token differs in any layer.</p>\n");
        return;
    }
    let threshold = m.margins.as_ref().map(|g| g.median_all / 10.0);
    let _ = writeln!(
        b,
        "<p>The first {} tokens that differ, one lane each, a cell per compared layer (trainer order). {}</p>",
        m.lanes.len(),
        match threshold {
            Some(t) => format!("A near-tie has a margin under {t:.4} (a tenth of the median margin)."),
            None => "No side recorded logits: flips cannot be told from near-ties.".into(),
        }
    );
    b.push_str("<div class=\"scroll\">");
    b.push_str(&lane_grid(&m.lanes, m.layers.len(), threshold, &|p| m.layers[p].trainer));
    b.push_str("</div>");
    b.push_str(&legend(&[
        ("#cf222e", "real flip"),
        ("#d4a72c", "near-tie"),
        ("#8250df", "flip (no logits)"),
        ("#f6f8fa", "same experts"),
    ]));
    let rows = m.lanes.iter().map(|l| {
        let near = l.flips.iter().filter(|f| kind(f, threshold).0 == "near-tie").count();
        let smallest =
            l.flips.iter().filter_map(|f| f.margin).fold(None, |a: Option<f32>, x| Some(a.map_or(x, |a| a.min(x))));
        let first = &l.flips[0];
        vec![
            format!("={}", l.sequence),
            format!("={}", l.rollout),
            format!("={}", l.trainer),
            format!("={}", l.flips.len()),
            format!("={near}"),
            smallest.map_or("=–".into(), |x| format!("={x:.4}")),
            format!(
                "layer {}: [{}] vs [{}]",
                m.layers[first.layer].trainer,
                esc(&ids(&first.rollout)),
                esc(&ids(&first.trainer))
            ),
        ]
    });
    table(
        b,
        &[
            "sequence",
            "rollout row",
            "trainer row",
            "flips",
            "near-ties",
            "smallest margin",
            "first flip (rollout vs trainer)",
        ],
        rows,
    );
}

/// Lanes as rows of cells, one per layer, coloured by the flip's kind.
fn lane_grid(lanes: &[Lane], layers: usize, threshold: Option<f64>, trainer: &dyn Fn(usize) -> usize) -> String {
    let cw = (760 / layers.max(1) as i64).clamp(6, 40);
    let (rh, left, top) = (12i64, 110i64, 16i64);
    let width = left + cw * layers as i64 + 10;
    let height = top + rh * lanes.len() as i64 + 4;
    let mut out = format!("<svg width=\"{width}\" height=\"{height}\" role=\"img\">");
    let every = [1, 2, 4, 8, 16].into_iter().find(|s| s * cw >= 24).unwrap_or(32) as usize;
    for p in (0..layers).step_by(every) {
        let _ =
            write!(out, "<text x=\"{}\" y=\"11\" style=\"font-size:9px\">{}</text>", left + p as i64 * cw, trainer(p));
    }
    for (i, l) in lanes.iter().enumerate() {
        let y = top + i as i64 * rh;
        let _ = write!(
            out,
            "<text x=\"0\" y=\"{}\" style=\"font-size:9px\">seq {} row {}</text><rect x=\"{left}\" y=\"{y}\" width=\"{}\" height=\"{}\" fill=\"#f6f8fa\"/>",
            y + rh - 2,
            l.sequence,
            l.trainer,
            cw * layers as i64,
            rh - 1
        );
        for f in &l.flips {
            let (word, colour) = kind(f, threshold);
            let margin = f.margin.map_or(String::new(), |m| format!(", margin {m:.4}"));
            let _ = write!(
                out,
                "<rect x=\"{}\" y=\"{y}\" width=\"{}\" height=\"{}\" fill=\"{colour}\"><title>{}</title></rect>",
                left + f.layer as i64 * cw,
                cw - 1,
                rh - 1,
                esc(&format!(
                    "trainer layer {}: {word}{margin}; rollout [{}] vs trainer [{}]",
                    trainer(f.layer),
                    ids(&f.rollout),
                    ids(&f.trainer)
                ))
            );
        }
    }
    out.push_str("</svg>\n");
    out
}
