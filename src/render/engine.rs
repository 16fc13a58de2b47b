//! `moe-audit engine`'s report as text: the servers, one row per axis, the first changes, the
//! disagreement per layer where an axis changed, and what the responses cannot tell.

use crate::engine::{Axis, AxisReport, Report, ServerInfo};
use std::fmt::Write;

fn server_line(s: &ServerInfo) -> String {
    let settings: Vec<String> = s.settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let settings = if settings.is_empty() { String::new() } else { format!(" [{}]", settings.join(", ")) };
    format!("{} {} at {}, model {}{settings}", s.engine.name(), s.version, s.url, s.model)
}

/// The axis's verdict word.
pub(crate) fn axis_verdict(a: &AxisReport) -> &'static str {
    match (a.decisions, a.held(), a.must_hold) {
        (0, true, _) => "nothing compared",
        (_, true, _) => "held",
        (_, false, true) => "CHANGED (must hold)",
        (_, false, false) => "changed",
    }
}

/// Why an axis compared nothing, when it did not.
pub(crate) fn axis_note(a: &AxisReport) -> Option<String> {
    if a.axis == Axis::Stale && a.decisions == 0 && !a.cached.is_empty() {
        return Some("no prompt token was served from the cache (prefix caching off, or prompts under a block)".into());
    }
    if matches!(a.axis, Axis::Cache | Axis::Stale) && !a.cached.is_empty() {
        let known: Vec<usize> = a.cached.iter().flatten().copied().collect();
        return Some(if known.is_empty() {
            let compared = if a.axis == Axis::Stale { ": the filling prompt's rows are compared" } else { "" };
            format!(
                "the server does not say how many prompt tokens it served from the cache (vLLM: \
                 --enable-prompt-tokens-details){compared}"
            )
        } else {
            format!(
                "cached prompt tokens per hit: {}..{} ({} of {} hits reported)",
                known.iter().min().unwrap_or(&0),
                known.iter().max().unwrap_or(&0),
                known.len(),
                a.cached.len()
            )
        });
    }
    None
}

/// The report as text.
pub(crate) fn engine_text(r: &Report) -> String {
    let mut out = String::new();
    let s = &r.settings;
    let _ = writeln!(out, "moe-audit engine: {}", server_line(&r.server));
    if let Some(a) = &r.against {
        let _ = writeln!(out, "  against: {}", server_line(a));
    }
    let _ = writeln!(
        out,
        "  {} probe prompts of {}-{} tokens, {} generated, {} batch-mates, seed {}; {} requests, at most {} in flight\n",
        s.prompts, s.prompt_len.0, s.prompt_len.1, s.generate, s.mates, s.seed, r.requests, s.concurrency
    );
    let _ = writeln!(
        out,
        "{:<13} {:>5} {:>9} {:>16} {:>8} {:>8}  verdict",
        "axis", "pairs", "decisions", "changed", "one-slot", "diverged"
    );
    for a in &r.axes {
        let _ = writeln!(
            out,
            "{:<13} {:>5} {:>9} {:>16} {:>8} {:>8}  {}",
            a.axis.name(),
            a.pairs,
            a.decisions,
            format!("{} ({:.3}%)", a.changed, 100.0 * a.share()),
            a.one_slot,
            a.diverged.len(),
            axis_verdict(a)
        );
    }
    for a in &r.axes {
        if let Some(note) = axis_note(a) {
            let _ = writeln!(out, "  {}: {note}", a.axis.name());
        }
    }
    for a in r.axes.iter().filter(|a| !a.held()) {
        let _ = writeln!(out, "\n{}: {}", a.axis.name(), a.axis.about());
        for d in &a.diverged {
            let _ = writeln!(out, "  probe {}: generated tokens differ from position {}", d.probe, d.position);
        }
        for c in &a.changes {
            let _ =
                writeln!(out, "  probe {} position {} layer {}: {:?} -> {:?}", c.probe, c.position, c.layer, c.a, c.b);
        }
        if a.changed > a.changes.len() {
            let _ = writeln!(out, "  ... and {} more", a.changed - a.changes.len());
        }
        if let Some(c) = &a.comparison {
            let layers: Vec<String> = c
                .measures
                .layers
                .iter()
                .filter(|l| l.differ > 0.0)
                .map(|l| format!("{} {:.2}%", l.rollout, 100.0 * l.differ))
                .collect();
            if !layers.is_empty() {
                let _ = writeln!(out, "  per layer: {}", layers.join(", "));
            }
        }
    }
    if r.axes.iter().any(|a| a.changed > 0) {
        out.push_str(
            "\nnear-ties: the engine returns no router logits. A change of one expert of the top-k (one-slot) is \
             what a near-tie at the k-th/(k+1)-th boundary looks like, and also what a small numeric difference \
             makes; without logits the two cannot be told apart. A change of more than one slot is not one \
             near-tie.\n",
        );
    }
    let must: Vec<&str> = r.axes.iter().filter(|a| a.must_hold).map(|a| a.axis.name()).collect();
    let _ = writeln!(
        out,
        "\nmust hold: {} -> {}",
        if must.is_empty() { "none".to_string() } else { must.join(", ") },
        if r.failed { "FAILED" } else { "ok" }
    );
    out
}

/// A replayed witness, as text.
pub(crate) fn engine_replay_text(a: &AxisReport) -> String {
    let mut out = format!(
        "{}: {} of {} decisions changed ({:.3}%), {} pairs diverged: {}\n",
        a.axis.name(),
        a.changed,
        a.decisions,
        100.0 * a.share(),
        a.diverged.len(),
        if a.held() { "the change is gone" } else { "the change reproduces" }
    );
    for c in &a.changes {
        let _ = writeln!(out, "  probe {} position {} layer {}: {:?} -> {:?}", c.probe, c.position, c.layer, c.a, c.b);
    }
    out
}
