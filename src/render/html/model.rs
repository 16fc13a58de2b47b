//! A whole-model audit as a page: the verdicts per probe and layer; per probe, layers ×
//! positions heatmaps of where routing first changed and where a change was carried from an
//! earlier layer, and the output drift per position; generation against training per layer;
//! each witness as two strips of token ids.

use super::check::routes_table;
use super::page::{badge, esc, legend, page, pct, table, verdict_badge};
use super::svg::{bars, heatmap, strips, Bar, Cell, Strip};
use crate::analyze::Probe;
use crate::analyze::Verdict;
use crate::model::answer_diff::OUTPUT_TOLERANCE;
use crate::model::audit::{ModelFinding, ModelReport, TokenWitness};
use crate::model::TokenCall;
use crate::render::model::layers_line;
use std::fmt::Write;

/// Output differences drawn from this relative size up (a log scale down to it).
const FLOOR: f64 = 1e-8;
/// Columns of a drawing along the sequence: a longer sequence is drawn in spans of positions,
/// so that a page stays a few MB whatever `--seq-len`.
const COLUMNS: usize = 256;

/// Positions per column for `len` positions.
fn span(len: usize) -> usize {
    len.div_ceil(COLUMNS).max(1)
}

/// The positions `[c * span, (c + 1) * span)` of column `c`, in words.
fn positions(c: usize, span: usize) -> String {
    match span {
        1 => format!("position {c}"),
        _ => format!("positions {}-{}", c * span, (c + 1) * span - 1),
    }
}

/// The audit of a model as one HTML document.
pub(crate) fn model_html(report: &ModelReport) -> String {
    let (info, o) = (&report.model, &report.options);
    let mut b = format!("<h1>moe-audit model: {}</h1>\n", esc(&info.name));
    let _ = writeln!(
        b,
        "<p class=\"sub\">vocab {}; layers {}<br>audit: batch {} × seq_len {}, {} trials, seed {}</p>",
        info.vocab,
        esc(&layers_line(info)),
        o.batch,
        o.seq_len,
        o.trials,
        o.seed
    );
    let leaking: Vec<String> =
        report.findings.iter().filter(|f| f.verdict == Verdict::Leak).map(|f| format!("{:?}", f.probe)).collect();
    let _ = match leaking.is_empty() {
        true => writeln!(b, "<div class=\"summary pass\">no probe leaks</div>"),
        false => writeln!(b, "<div class=\"summary leak\">leaks under probe(s) {}</div>", leaking.join(", ")),
    };
    let latent: Vec<String> =
        report.findings.iter().filter(|f| f.verdict == Verdict::Latent).map(|f| format!("{:?}", f.probe)).collect();
    if !latent.is_empty() {
        let _ = writeln!(
            b,
            "<div class=\"summary latent\">latent under probe(s) {}: only the capacity in force changed, no decision did</div>",
            latent.join(", ")
        );
    }
    verdicts(&mut b, report);
    for f in report.findings.iter().filter(|f| f.verdict != Verdict::NotApplicable) {
        finding(&mut b, f);
    }
    page(&format!("moe-audit model: {}", info.name), &b)
}

fn verdicts(b: &mut String, report: &ModelReport) {
    let routed: Vec<String> = report.model.routed().map(|l| format!("layer {}", l.layer)).collect();
    let mut header = vec!["probe", "property", "verdict", "cases", "first layer"];
    header.extend(routed.iter().map(String::as_str));
    header.extend(["outputs", "note"]);
    let rows = report.findings.iter().map(|f| {
        let mut row = vec![
            format!("<a href=\"#probe-{:?}\">{:?} {}</a>", f.probe, f.probe, esc(f.probe.name())),
            esc(&f.property.to_string()),
            verdict_badge(f.verdict),
            format!("={}", f.cases),
            format!("={}", f.first_layer.map_or("–".into(), |l| l.to_string())),
        ];
        for t in &f.layers {
            row.push(if f.verdict == Verdict::NotApplicable { "=–".into() } else { format!("={}", pct(t.rate, 2)) });
        }
        row.push(match f.outputs.compared {
            0 => "=–".into(),
            n => format!("={}", pct(f.outputs.changed as f64 / n as f64, 2)),
        });
        row.push(esc(&f.note));
        row
    });
    b.push_str("<div class=\"scroll\">");
    table(b, &header, rows);
    b.push_str("</div>");
}

fn finding(b: &mut String, f: &ModelFinding) {
    let _ = writeln!(
        b,
        "<h2 id=\"probe-{:?}\">{:?} {} {}</h2>\n<p>{} of {} cases leak, {} change only the capacity in force (latent), {} differ by numerics only (near-ties on logits that moved); {} output rows changed beyond f32 tolerance.</p>",
        f.probe,
        f.probe,
        esc(f.probe.name()),
        verdict_badge(f.verdict),
        f.leak_cases,
        f.cases,
        f.latent_cases,
        f.drift_cases,
        f.outputs.changed
    );
    let p = &f.positions;
    let labels: Vec<String> = f.layers.iter().map(|t| format!("layer {}", t.layer)).collect();
    let span = span(p.output.len());
    // Counts summed over each column's positions.
    let grid = |g: &[Vec<usize>]| {
        g.iter().map(|r| r.chunks(span).map(|c| c.iter().sum::<usize>() as f64).collect()).collect::<Vec<Vec<f64>>>()
    };
    if p.first.iter().flatten().any(|&v| v > 0) {
        b.push_str("<h3>Where routing first changed (layers × positions)</h3><div class=\"scroll\">");
        let title = |r: usize, c: usize, v: f64| {
            format!("{}, {}: {v} token(s) changed first here", labels[r], positions(c, span))
        };
        b.push_str(&heatmap(&grid(&p.first), &labels, span, (207, 34, 46), &title));
        b.push_str("</div><h3>Where a change was carried from an earlier layer</h3><div class=\"scroll\">");
        let title = |r: usize, c: usize, v: f64| {
            format!("{}, {}: {v} token(s) carried a change from before", labels[r], positions(c, span))
        };
        b.push_str(&heatmap(&grid(&p.carried), &labels, span, (9, 105, 218), &title));
        b.push_str("</div>");
    }
    if p.output.iter().any(|d| d.is_some_and(|d| d > 0.0)) {
        output_drift(b, &p.output);
    }
    if f.probe == Probe::G {
        generation(b, f);
    }
    if let Some(w) = &f.witness {
        witness(b, w);
    }
}

/// The largest relative difference of an output row per position, on a log scale.
fn output_drift(b: &mut String, output: &[Option<f64>]) {
    b.push_str("<h3>Output drift per position (largest relative difference of a row)</h3><div class=\"scroll\">");
    let decades = -FLOOR.log10();
    let span = span(output.len());
    // The largest difference over each column's positions.
    let items: Vec<Bar> = output
        .chunks(span)
        .enumerate()
        .map(|(c, ds)| {
            let d = ds.iter().flatten().copied().fold(0.0, f64::max);
            let height = if d > FLOOR { d.log10() + decades } else { 0.0 };
            let colour = if d > OUTPUT_TOLERANCE { "#cf222e" } else { "#bf8700" };
            Bar {
                label: (c * span).to_string(),
                parts: vec![(height, colour, format!("{}: {d:.2e}", positions(c, span)))],
            }
        })
        .collect();
    b.push_str(&bars(&items, decades, &|v| format!("1e{}", (v - decades).round())));
    b.push_str("</div>");
    b.push_str(&legend(&[
        ("#cf222e", &format!("beyond the f32 tolerance {OUTPUT_TOLERANCE:e}")),
        ("#bf8700", "within it (numerics)"),
    ]));
}

/// Generation against training per layer: tokens that disagree, near-ties apart from real
/// changes, with their margins.
fn generation(b: &mut String, f: &ModelFinding) {
    b.push_str("<h3>Generation against training, per layer</h3>");
    let share = |n: usize, of: usize| n as f64 / of.max(1) as f64;
    let items: Vec<Bar> = f
        .layers
        .iter()
        .map(|t| {
            let disagree = t.changed + t.drift;
            let real = disagree - t.near_ties;
            Bar {
                label: format!("layer {}", t.layer),
                parts: vec![
                    (share(real, t.compared), "#cf222e", format!("layer {}: {real} real", t.layer)),
                    (
                        share(t.near_ties, t.compared),
                        "#bf8700",
                        format!("layer {}: {} near-ties", t.layer, t.near_ties),
                    ),
                ],
            }
        })
        .collect();
    let max = items.iter().map(|i| i.parts.iter().map(|p| p.0).sum::<f64>()).fold(0.0, f64::max);
    b.push_str(&bars(&items, max, &|v| pct(v, 2)));
    b.push_str(&legend(&[("#cf222e", "real changes"), ("#bf8700", "near-ties (numerics)")]));
    let margin = |m: Option<f32>| m.map_or("=–".into(), |m| format!("={m:.3e}"));
    let rows = f.layers.iter().map(|t| {
        let disagree = t.changed + t.drift;
        vec![
            format!("={}", t.layer),
            format!("={}", t.compared),
            format!("={disagree}"),
            format!("={}", pct(share(disagree, t.compared), 2)),
            format!("={}", t.near_ties),
            margin(t.max_tie_margin),
            format!("={}", disagree - t.near_ties),
            margin(t.min_real_margin),
        ]
    });
    table(
        b,
        &["layer", "tokens", "disagree", "share", "near-ties", "largest tie margin", "real", "smallest real margin"],
        rows,
    );
}

fn witness(b: &mut String, w: &TokenWitness) {
    let at = w.layer.map_or("its output row".to_string(), |l| format!("layer {l}"));
    let _ = writeln!(
        b,
        "<h3>Witness: sequence {}, position {} at {}; {} changed</h3>\n<p class=\"sub\">a: {}; b: {}</p>",
        w.token_a.0,
        w.token_a.1,
        esc(&at),
        esc(&w.changed),
        esc(&w.a.describe()),
        esc(&w.b.describe())
    );
    let rows =
        [strip("call a", &w.a, w.token_a, (&w.b, w.token_b)), strip("call b", &w.b, w.token_b, (&w.a, w.token_a))];
    b.push_str("<div class=\"scroll\">");
    b.push_str(&strips(&rows));
    b.push_str("</div>");
    b.push_str(&legend(&[
        ("#ffebe9", "the witness token"),
        ("#ffd8a8", "token differs from the other call"),
        ("#d0d7de", "padding"),
        ("#f6f8fa", "same token"),
    ]));
    if w.layer.is_some() {
        routes_table(b, (&w.routes_a, None), (&w.routes_b, None));
    } else {
        let _ = writeln!(b, "<p>{}</p>", badge("leak", "its output row changed, its routing did not"));
    }
}

/// One sequence of a token call, token ids in the cells; tokens that differ from `other`'s
/// (aligned on the witness token) are marked.
fn strip(label: &str, call: &TokenCall, (seq, focus): (usize, usize), other: (&TokenCall, (usize, usize))) -> Strip {
    let (o, (os, of)) = other;
    let id = |c: &TokenCall, s: usize, p: usize| c.tokens.get(s * c.seq_len + p).copied();
    let cells = (0..call.seq_len)
        .map(|pos| {
            let padded = call.padding.as_ref().is_some_and(|m| m.get(seq * call.seq_len + pos) == Some(&true));
            let at = (pos + of).checked_sub(focus).filter(|&p| p < o.seq_len);
            let differs = at.is_none_or(|p| id(o, os, p) != id(call, seq, pos));
            let (fill, what) = match (pos == focus, padded, differs) {
                (true, _, _) => ("#ffebe9", "the witness token"),
                (_, true, _) => ("#d0d7de", "padding"),
                (_, _, true) => ("#ffd8a8", "differs from the other call"),
                _ => ("#f6f8fa", "same token"),
            };
            let token = id(call, seq, pos).map_or(String::new(), |t| t.to_string());
            Cell {
                pos,
                title: format!("{label}, position {pos}: token {token}, {what}"),
                text: token,
                fill,
                mark: pos == focus,
            }
        })
        .collect();
    Strip { label: format!("{label} (sequence {seq})"), focus, cells }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_sequence_is_drawn_in_spans_of_positions() {
        assert_eq!((span(0), span(128), span(256), span(257), span(4096)), (1, 1, 1, 2, 16));
        assert_eq!(positions(3, 1), "position 3");
        assert_eq!(positions(3, 4), "positions 12-15");
    }
}
