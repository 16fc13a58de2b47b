//! A router audit as a page: the verdict table beside each router's load balance, every
//! explanation and fix, each witness as two token strips with the token's experts and gates
//! before and after, and (several routers) load balance against leak rate.

use super::page::{badge, esc, page, pct, table, verdict_badge};
use super::svg::{scatter, strips, Cell, Point, Strip};
use crate::analyze::witness::StoredCall;
use crate::analyze::{Finding, Report, RouterReport, Verdict, Witness};
use crate::render::text::{details, inconclusive_line, latent_line, once_per_router, rate, why};
use crate::routing::Route;
use std::fmt::Write;

/// The audit of routers as one HTML document.
pub(crate) fn check_html(report: &Report) -> String {
    let o = &report.options;
    let mut b = String::from("<h1>moe-audit check</h1>\n");
    let probes: Vec<String> = o.probes.iter().map(|p| format!("{p} {}", p.name())).collect();
    let _ = writeln!(
        b,
        "<p class=\"sub\">batch {} × seq {}, {} trials, seed {}; probes: {}</p>",
        o.batch,
        o.seq_len,
        o.trials,
        o.seed,
        esc(&probes.join(", "))
    );
    summary(&mut b, report);
    if report.routers.len() > 1 {
        b.push_str("<h2>Load balance against leaks</h2>\n");
        let points: Vec<Point> = report
            .routers
            .iter()
            .map(|r| Point {
                x: r.load.max_over_mean_load,
                y: leak_rate(r),
                label: r.router.clone(),
                fill: match (r.leaks(), r.latent()) {
                    (true, _) => "#cf222e",
                    (false, true) => "#bc4c00",
                    (false, false) => "#2da44e",
                },
            })
            .collect();
        b.push_str(&scatter(
            &points,
            "max/mean expert load (routed, before dropping)",
            "leak rate (largest of the router's probes)",
            &|y| pct(y, 1),
        ));
    }
    for (i, r) in report.routers.iter().enumerate() {
        router(&mut b, i, r);
    }
    page(&format!("moe-audit check: {} router(s)", report.routers.len()), &b)
}

/// The largest rate of a leaking probe (0 when none leaks).
fn leak_rate(r: &RouterReport) -> f64 {
    r.findings.iter().filter(|f| f.verdict == Verdict::Leak).map(|f| f.rate).fold(0.0, f64::max)
}

fn summary(b: &mut String, report: &Report) {
    let n = report.routers.len();
    let leaking: Vec<&str> = report.routers.iter().filter(|r| r.leaks()).map(|r| r.router.as_str()).collect();
    let (class, line) = match leaking.is_empty() {
        true => ("pass", format!("no leak found in {n} router(s)")),
        false => ("leak", format!("{} of {n} router(s) leak: {}", leaking.len(), leaking.join(", "))),
    };
    let _ = writeln!(b, "<div class=\"summary {class}\">{}</div>", esc(&line));
    if let Some(line) = latent_line(report) {
        let _ = writeln!(b, "<div class=\"summary latent\">{}</div>", esc(&line));
    }
    if let Some(line) = inconclusive_line(report) {
        let _ = writeln!(b, "<div class=\"summary inconclusive\">{}</div>", esc(&line));
    }
}

fn router(b: &mut String, i: usize, r: &RouterReport) {
    let _ = writeln!(b, "<h2 id=\"router-{i}\">{}</h2>\n<div class=\"row\"><div class=\"grow\">", esc(&r.router));
    // As in the text table: a fix is written once per router, then "as above".
    let mut fixes: Vec<String> = Vec::new();
    let rows = r.findings.iter().map(|f| {
        let cell = if f.verdict == Verdict::NotApplicable { "=–".into() } else { format!("={}", rate(f)) };
        vec![
            format!("{} {}", f.probe, esc(f.probe.name())),
            verdict_badge(f.verdict),
            esc(&f.property.to_string()),
            cell,
            explanation(f, &mut fixes),
        ]
    });
    let invariants = r.invariants.iter().map(|v| {
        vec!["invariant".into(), badge("leak", "FAIL"), "–".into(), "=–".into(), format!("<span>{}</span>", esc(v))]
    });
    table(b, &["probe", "verdict", "property", "rate", "why"], rows.chain(invariants));
    b.push_str("</div>\n<div class=\"card\"><h3>Load balance</h3>");
    let l = &r.load;
    table(
        b,
        &["measure", "value"],
        [
            vec!["max/mean load".into(), format!("={:.3}", l.max_over_mean_load)],
            vec!["load CV".into(), format!("={:.3}", l.load_cv)],
            vec!["drop rate".into(), format!("={}", pct(l.drop_rate, 1))],
            vec!["aux loss".into(), format!("={:.3}", l.aux_loss)],
        ],
    );
    b.push_str("</div></div>\n");
    for f in r.findings.iter() {
        if let Some(w) = &f.witness {
            witness(b, f, w);
        }
    }
}

/// Why, then the explanation's lines (compared, changed, fix).
fn explanation(f: &Finding, fixes: &mut Vec<String>) -> String {
    let mut out = esc(&why(f));
    for (label, text) in details(f) {
        let text = once_per_router(fixes, label, text);
        let _ = write!(out, "<div class=\"details\"><b>{label}:</b> {}</div>", esc(&text));
    }
    out
}

fn witness(b: &mut String, f: &Finding, w: &Witness) {
    let _ = writeln!(
        b,
        "<h3>{} {}: witness (sequence {}, position {}; {} changed)</h3>",
        f.probe,
        esc(f.probe.name()),
        w.token_a.batch,
        w.token_a.pos,
        esc(&w.differs)
    );
    if let Some(e) = &f.explain {
        let _ = writeln!(b, "<p class=\"sub\">a: {}; b: {}</p>", esc(&e.calls[0]), esc(&e.calls[1]));
    }
    // D and M route call `a` twice (their `b` is unused): one strip.
    let one_call = matches!(f.probe, crate::analyze::Probe::D | crate::analyze::Probe::M);
    let (a, b_) = ((&w.a, w.token_a.batch, w.token_a.pos), (&w.b, w.token_b.batch, w.token_b.pos));
    let mut rows = vec![strip("call a", a, (!one_call).then_some(b_))];
    if !one_call {
        rows.push(strip("call b", b_, Some(a)));
    }
    b.push_str("<div class=\"scroll\">");
    b.push_str(&strips(&rows));
    b.push_str("</div>");
    b.push_str(&super::page::legend(&[
        ("#ffebe9", "the witness token (its routing changed)"),
        ("#ffd8a8", "input differs from the other call"),
        ("#d0d7de", "padding"),
        ("#f6f8fa", "same input"),
    ]));
    routes_table(b, (&w.before.routes, w.before.capacity), (&w.after.routes, w.after.capacity));
}

/// Row `p` of sequence `s` of a call.
fn row(c: &StoredCall, s: usize, p: usize) -> Option<&Vec<f32>> {
    c.logits.get(s * c.seq_len + p)
}

/// A call's sequence and the witness token's position in it.
type Token<'a> = (&'a StoredCall, usize, usize);

/// The witness token's sequence of a stored call as a strip; with `other`, inputs that differ
/// from the other call's (aligned on the witness token) are marked.
fn strip(label: &str, (call, seq, focus): Token, other: Option<Token>) -> Strip {
    let cells = (0..call.seq_len)
        .map(|pos| {
            let padded = call.padding.as_ref().is_some_and(|m| m.get(seq).and_then(|r| r.get(pos)) == Some(&true));
            let differs = other.is_some_and(|(o, os, of)| {
                let at = (pos + of).checked_sub(focus).filter(|&p| p < o.seq_len);
                at.is_none_or(|p| row(o, os, p) != row(call, seq, pos))
            });
            let (fill, what) = match (pos == focus, padded, differs) {
                (true, _, _) => ("#ffebe9", "the witness token"),
                (_, true, _) => ("#d0d7de", "padding"),
                (_, _, true) => ("#ffd8a8", "input differs from the other call"),
                _ => ("#f6f8fa", "same input"),
            };
            Cell {
                pos,
                text: String::new(),
                fill,
                title: format!("{label}, position {pos}: {what}"),
                mark: pos == focus,
            }
        })
        .collect();
    Strip { label: format!("{label} (sequence {seq})"), focus, cells }
}

fn route(r: Option<&Route>) -> [String; 3] {
    match r {
        None => ["".into(), "".into(), "".into()],
        Some(r) => [
            format!("={}", r.expert),
            format!("={:.4}", r.weight),
            if r.padded {
                "padding".into()
            } else if r.kept {
                "kept".into()
            } else {
                badge("leak", "dropped")
            },
        ],
    }
}

/// A token's routes and the capacity in force for it, when not its group's.
type Routes<'a> = (&'a [Route], Option<usize>);

/// The token's routes before and after, slot by slot; a changed slot is marked.
pub(super) fn routes_table(b: &mut String, (before, cap_a): Routes, (after, cap_b): Routes) {
    let slots = before.len().max(after.len());
    let rows = (0..slots).map(|i| {
        let (x, y) = (before.get(i), after.get(i));
        let same = x == y;
        let mut row = vec![format!("={}", i + 1)];
        row.extend(route(x));
        row.extend(route(y));
        row.push(if same { "".into() } else { badge("leak", "changed") });
        row
    });
    let capacity = |c: Option<usize>| c.map_or("–".to_string(), |c| c.to_string());
    let capacity_row = (cap_a.is_some() || cap_b.is_some()).then(|| {
        vec![
            "capacity".into(),
            format!("={}", capacity(cap_a)),
            "".into(),
            "".into(),
            format!("={}", capacity(cap_b)),
            "".into(),
            "".into(),
            if cap_a == cap_b { "".into() } else { badge("leak", "changed") },
        ]
    });
    table(b, &["slot", "expert before", "gate", "", "expert after", "gate", "", ""], rows.chain(capacity_row));
}
