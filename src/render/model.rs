//! The whole-model audit as text: one row per probe with its leak rate at every routed layer,
//! then for each leak where it started and how it spread, its witness, and the generation
//! probe's disagreements with their top-k margins. JSON is the serde form of [`ModelReport`].

use super::text::verdict_word;
use crate::analyze::Probe;
use crate::analyze::Verdict;
use crate::model::audit::{ModelFinding, ModelReport, TokenWitness};
use crate::model::{LayerKind, ModelInfo};
use crate::routing::Route;
use std::fmt::Write;

/// The model's layers in a few words: `0 dense, 1-3 moe (8 experts, top 2)`.
pub(crate) fn layers_line(info: &ModelInfo) -> String {
    let mut runs: Vec<(usize, usize, String)> = Vec::new();
    for l in &info.layers {
        let word = match (l.kind, l.top_k) {
            (LayerKind::Dense, _) => "dense".to_string(),
            (kind, k) => {
                let kind = if kind == LayerKind::Mtp { "mtp" } else { "moe" };
                let k = k.map_or("expert choice".to_string(), |k| format!("top {k}"));
                format!("{kind} ({} experts, {k})", l.experts.unwrap_or(0))
            }
        };
        match runs.last_mut() {
            Some((_, last, w)) if *w == word && *last + 1 == l.layer => *last = l.layer,
            _ => runs.push((l.layer, l.layer, word)),
        }
    }
    let run = |(a, b, w): &(usize, usize, String)| match a == b {
        true => format!("{a} {w}"),
        false => format!("{a}-{b} {w}"),
    };
    runs.iter().map(run).collect::<Vec<_>>().join(", ")
}

fn routes(rs: &[Route]) -> String {
    let one = |r: &Route| format!("{} {:.4}{}", r.expert, r.weight, if r.kept { "" } else { " dropped" });
    format!("[{}]", rs.iter().map(one).collect::<Vec<_>>().join(", "))
}

/// A witness in two lines: the token and what changed, then the two calls.
pub(crate) fn witness_lines(w: &TokenWitness) -> Vec<String> {
    let (s, p) = w.token_a;
    let at = match w.layer {
        Some(l) => format!("layer {l}: {} changed, {} -> {}", w.changed, routes(&w.routes_a), routes(&w.routes_b)),
        None => "its output row changed, its routing did not".to_string(),
    };
    vec![
        format!("witness: sequence {s}, position {p} (token id {}), {at}", w.a.tokens[s * w.a.seq_len + p]),
        format!("compared: \"{}\" vs \"{}\"", w.a.describe(), w.b.describe()),
    ]
}

/// How a leak started and spread: per layer, tokens changed first there and carried from before.
fn spread(f: &ModelFinding) -> String {
    let per: Vec<String> = f
        .layers
        .iter()
        .filter(|t| t.changed > 0)
        .map(|t| format!("layer {}: {} first, {} carried", t.layer, t.first, t.inherited))
        .collect();
    per.join("; ")
}

/// The whole-model report for a terminal.
pub(crate) fn render_model_text(report: &ModelReport) -> String {
    let info = &report.model;
    let o = &report.options;
    let mut s = String::new();
    let extras: Vec<String> = [
        (info.outputs > 0).then(|| format!("output rows of {}", info.outputs)),
        info.logits.then(|| "router logits".to_string()),
        info.padding_mask.then(|| "padding mask".to_string()),
        info.generate.then(|| "generation path".to_string()),
    ]
    .into_iter()
    .flatten()
    .collect();
    let _ =
        writeln!(s, "model {}: vocab {}; layers {}; {}", info.name, info.vocab, layers_line(info), extras.join(", "));
    let _ = writeln!(s, "audit: batch {} x seq_len {}, {} trials, seed {}\n", o.batch, o.seq_len, o.trials, o.seed);
    let routed: Vec<usize> = info.routed().map(|l| l.layer).collect();
    let verdict = super::text::verdict_width("verdict", report.findings.iter().map(|f| f.verdict));
    let mut header = format!("{:<14} {:<9} {:<verdict$} {:>5} {:>6}", "probe", "property", "verdict", "cases", "first");
    routed.iter().for_each(|l| {
        let _ = write!(header, " {:>9}", format!("layer {l}"));
    });
    let _ = writeln!(s, "{header} {:>9}", "outputs");
    for f in &report.findings {
        let mut row = format!(
            "{:<14} {:<9} {:<verdict$} {:>5} {:>6}",
            format!("{:?} {}", f.probe, f.probe.name()),
            f.property.to_string(),
            verdict_word(f.verdict),
            f.cases,
            f.first_layer.map_or("-".into(), |l| l.to_string())
        );
        for t in &f.layers {
            let cell = if f.verdict == Verdict::NotApplicable { "-".into() } else { format!("{:.2}%", 100.0 * t.rate) };
            let _ = write!(row, " {cell:>9}");
        }
        let outputs = match (f.outputs.compared, f.outputs.changed) {
            (0, _) => "-".to_string(),
            (n, c) => format!("{:.2}%", 100.0 * c as f64 / n as f64),
        };
        let _ = writeln!(s, "{row} {outputs:>9}");
    }
    for f in &report.findings {
        let _ = writeln!(s, "\n{:?} {} ({}): {}", f.probe, f.probe.name(), verdict_word(f.verdict), f.note);
        if f.verdict == Verdict::Leak {
            let _ = writeln!(
                s,
                "  {} of {} cases leak; first at layer {}; {}",
                f.leak_cases,
                f.cases,
                f.first_layer.map_or("- (outputs only)".into(), |l| l.to_string()),
                spread(f)
            );
        }
        if f.latent_cases > 0 {
            let _ = writeln!(s, "  {} cases change only the capacity in force, no decision (latent)", f.latent_cases);
        }
        if f.drift_cases > 0 {
            let _ = writeln!(s, "  {} cases differ by numerics only (near-ties on logits that moved)", f.drift_cases);
        }
        if f.outputs.changed > 0 {
            let _ = writeln!(s, "  {} output rows changed beyond f32 tolerance", f.outputs.changed);
        }
        if let Some(d) = f.outputs.drift {
            let _ = writeln!(s, "  outputs within tolerance differ by up to {d:.2e} (relative)");
        }
        if f.probe == Probe::G && f.verdict != Verdict::NotApplicable {
            for t in &f.layers {
                let disagree = t.changed + t.drift;
                let margin = |m: Option<f32>| m.map_or("-".into(), |m| format!("{m:.3e}"));
                let _ = writeln!(
                    s,
                    "  layer {}: {disagree} of {} tokens disagree ({:.2}%): {} near-ties (largest margin {}), {} real (smallest expert-change margin {})",
                    t.layer,
                    t.compared,
                    100.0 * disagree as f64 / t.compared.max(1) as f64,
                    t.near_ties,
                    margin(t.max_tie_margin),
                    disagree - t.near_ties,
                    margin(t.min_real_margin)
                );
            }
        }
        if let Some(w) = &f.witness {
            witness_lines(w).iter().for_each(|l| {
                let _ = writeln!(s, "  {l}");
            });
        }
    }
    s
}

/// The outcome of `model --replay`: the token's verdict now (`LEAK reproduced`, `LATENT
/// reproduced` when only the capacity in force changes, or `no longer leaks`).
pub(crate) fn render_model_replay(w: &TokenWitness, verdict: Verdict) -> String {
    let at = w.layer.map_or("its output row".to_string(), |l| format!("layer {l}"));
    let said = match verdict {
        Verdict::Pass => "no longer leaks".to_string(),
        v => format!("{} reproduced", verdict_word(v).to_uppercase()),
    };
    format!(
        "{} {:?} {}: sequence {}, position {} at {at}: {said}\n",
        w.model,
        w.probe,
        w.probe.name(),
        w.token_a.0,
        w.token_a.1
    )
}
