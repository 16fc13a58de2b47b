//! Rendering reports: a terminal table (which routers leak, how often, why), markdown for a CI
//! summary, the zoo's verdict table beside load balance, and a witness replay. JSON is the serde
//! form of [`Report`].

use crate::analyze::witness::ReplayOutcome;
use crate::analyze::{Finding, Probe, Report, RouterReport, Verdict};
use std::fmt::Write;

pub(crate) fn verdict_word(v: Verdict) -> &'static str {
    match v {
        Verdict::Pass => "pass",
        Verdict::Leak => "LEAK",
        // Lower case: no decision changed, unlike a LEAK; it fails the default gate all the same.
        Verdict::Latent => "latent",
        Verdict::NotApplicable => "n/a",
        // JSON's word: one word for one verdict everywhere (columns widen to fit it).
        Verdict::Inconclusive => "inconclusive",
        Verdict::Drift => "drift",
    }
}

/// Width of a column of `verdicts`' words: at least `header`'s.
pub(crate) fn verdict_width(header: &str, verdicts: impl IntoIterator<Item = Verdict>) -> usize {
    verdicts.into_iter().map(|v| verdict_word(v).len()).fold(header.len(), usize::max)
}

/// Width of the router column: the longest name, at least 22 (where the table began).
fn router_width(report: &Report) -> usize {
    report.routers.iter().map(|r| r.router.chars().count()).fold(22, usize::max)
}

fn percent(rate: f64) -> String {
    format!("{:.1}%", rate * 100.0)
}

/// A finding's rate with one decimal; a leak too rare to show in one is `<0.1%`, so that `0.0%`
/// always means no decision changed (a pass, or a latent finding).
pub(crate) fn rate(f: &Finding) -> String {
    match f.verdict {
        Verdict::NotApplicable => "-".into(),
        _ if f.affected > 0 && f.rate < 0.0005 => "<0.1%".into(),
        _ => percent(f.rate),
    }
}

/// Why, in a few words: what changed, where, what caused it.
pub(crate) fn why(f: &Finding) -> String {
    if !matches!(f.verdict, Verdict::Leak | Verdict::Latent | Verdict::Drift) {
        return match f.capacity_changed {
            true => format!("{}; the capacity in force changed, no decision did", f.note),
            false => f.note.clone(),
        };
    }
    let mut parts = Vec::new();
    // D's note says the router is random (and the fix), S's when the same call changed.
    if f.numerics.is_some() || matches!(f.probe, Probe::D | Probe::S) {
        parts.push(f.note.clone());
    }
    if f.affected == 0 && f.capacity_changed {
        parts.push("the capacity in force changed, no decision did".into());
    } else if let Some(w) = &f.witness {
        parts.push(format!("{} changed", w.differs));
    }
    if let Some(p) = f.first_position {
        parts.push(format!("first at position {p}"));
    }
    if let Some(e) = &f.explain {
        parts.push(format!("cause: {}", e.cause));
    }
    if f.output_leaks > 0 {
        parts.push(format!("{} outputs changed with identical routing", f.output_leaks));
    }
    parts.join("; ")
}

/// A leak's explanation as labelled lines (every format prints these): the two calls and the
/// witness's token, what changed for it, how to fix.
pub(crate) fn details(f: &Finding) -> Vec<(&'static str, String)> {
    let Some(e) = &f.explain else { return Vec::new() };
    let mut calls = format!("\"{}\" vs \"{}\"", e.calls[0], e.calls[1]);
    if let Some(t) = e.token {
        let _ = write!(calls, "; witness token: sequence {}, position {}", t.batch, t.pos);
    }
    let mut out = vec![("compared", calls)];
    if let Some(c) = &e.changed {
        out.push(("changed", c.clone()));
    }
    out.push(("fix", e.fix.clone()));
    out
}

/// A detail's text, except a fix already written for this router (`fixes`), which is "as above":
/// the fix depends on the router's design more than on the probe.
pub(crate) fn once_per_router(fixes: &mut Vec<String>, label: &str, text: String) -> String {
    if label != "fix" {
        return text;
    }
    if fixes.contains(&text) {
        return "as above".into();
    }
    fixes.push(text.clone());
    text
}

/// The terminal table: one row per router × probe, then invariant failures and the summary.
pub(crate) fn render_text(report: &Report, witness_paths: &dyn Fn(&str, Probe) -> Option<String>) -> String {
    let mut out = String::new();
    let o = &report.options;
    let _ =
        writeln!(out, "moe-audit check: batch {} x seq {}, {} trials, seed {}", o.batch, o.seq_len, o.trials, o.seed);
    // Columns fit the longest router name and verdict word, so every row lines up.
    let width = router_width(report);
    let verdict = verdict_width("verdict", report.routers.iter().flat_map(|r| r.findings.iter().map(|f| f.verdict)));
    let _ = writeln!(
        out,
        "{:<width$} {:<12} {:<verdict$} {:<10} {:>7}  why",
        "router", "probe", "verdict", "property", "rate"
    );
    for r in &report.routers {
        // The fix depends on the design more than on the probe: say it once per router.
        let mut fixes: Vec<String> = Vec::new();
        for f in &r.findings {
            let mut line = format!(
                "{:<width$} {:<12} {:<verdict$} {:<10} {:>7}  {}",
                r.router,
                format!("{} {}", f.probe, f.probe.name()),
                verdict_word(f.verdict),
                f.property.to_string(),
                rate(f),
                why(f)
            );
            if let Some(path) = witness_paths(&r.router, f.probe) {
                let _ = write!(line, " [witness {path}]");
            }
            let _ = writeln!(out, "{}", line.trim_end());
            for (label, text) in details(f) {
                let _ = writeln!(out, "{:<width$}   {label}: {}", "", once_per_router(&mut fixes, label, text));
            }
        }
        for v in &r.invariants {
            let _ = writeln!(out, "{:<width$} {:<12} {:<verdict$} {v}", r.router, "invariant", "FAIL");
        }
    }
    // A router whose probes all passed but whose invariant failed is said as such, apart.
    let probe_leak = |r: &&RouterReport| r.findings.iter().any(|f| f.verdict == Verdict::Leak);
    let names = |rs: Vec<&RouterReport>| rs.iter().map(|r| r.router.as_str()).collect::<Vec<_>>().join(", ");
    let (leaking, broken): (Vec<&RouterReport>, Vec<&RouterReport>) =
        report.routers.iter().filter(|r| r.leaks()).partition(probe_leak);
    let n = report.routers.len();
    if leaking.is_empty() && broken.is_empty() {
        let _ = writeln!(out, "no leak found in {n} router(s)");
    }
    if !leaking.is_empty() {
        let _ = writeln!(out, "{} of {n} router(s) leak: {}", leaking.len(), names(leaking));
    }
    if !broken.is_empty() {
        let _ = writeln!(
            out,
            "{} of {n} router(s) break an invariant while every probe passed: {} (a capacity per sequence must be stated with its scope: moe-audit/2)",
            broken.len(),
            names(broken)
        );
    }
    if let Some(line) = latent_line(report) {
        let _ = writeln!(out, "{line}");
    }
    if let Some(line) = inconclusive_line(report) {
        let _ = writeln!(out, "{line}");
    }
    out
}

/// The line on routers with a latent dependence (they fail the default gate, exit 1): each
/// with its latent probes.
pub(crate) fn latent_line(report: &Report) -> Option<String> {
    let latent: Vec<String> = (report.routers.iter().filter(|r| r.latent()))
        .map(|r| {
            let probes = r.findings.iter().filter(|f| f.verdict == Verdict::Latent).map(|f| f.probe.to_string());
            format!("{} ({})", r.router, probes.collect::<Vec<_>>().join(" "))
        })
        .collect();
    (!latent.is_empty()).then(|| {
        format!(
            "{} of {} router(s) latent: {}: the capacity in force depends on what a token must not see; no decision changed on these inputs, one does where the capacity binds",
            latent.len(),
            report.routers.len(),
            latent.join(", ")
        )
    })
}

/// The line on random routers whose verdicts are inconclusive (they fail the gate, exit 1).
pub(crate) fn inconclusive_line(report: &Report) -> Option<String> {
    let random: Vec<&str> = report.routers.iter().filter(|r| r.inconclusive()).map(|r| r.router.as_str()).collect();
    (!random.is_empty()).then(|| {
        format!(
            "{} router(s) random, verdicts inconclusive: {}; fix: {}",
            random.len(),
            random.join(", "),
            crate::analyze::random_router_fix()
        )
    })
}

/// Markdown for a CI step summary.
pub(crate) fn render_markdown(report: &Report) -> String {
    let mut out = String::from("## moe-audit\n\n");
    let o = &report.options;
    let _ = writeln!(out, "batch {} × seq {}, {} trials, seed {}\n", o.batch, o.seq_len, o.trials, o.seed);
    out.push_str("| router | probe | verdict | property | rate | why |\n|---|---|---|---|---|---|\n");
    for r in &report.routers {
        // As in the text table: a fix is written once per router, then "as above".
        let mut fixes: Vec<String> = Vec::new();
        for f in &r.findings {
            let verdict = match f.verdict {
                Verdict::Leak => "❌ leak",
                Verdict::Latent => "⏳ latent",
                Verdict::Pass => "✅ pass",
                Verdict::NotApplicable => "n/a",
                Verdict::Inconclusive => "❔ inconclusive",
                Verdict::Drift => "⚠️ drift",
            };
            let _ = writeln!(
                out,
                "| `{}` | {} {} | {verdict} | {} | {} | {} |",
                crate::names::markdown(&r.router),
                f.probe,
                f.probe.name(),
                f.property,
                if f.verdict == Verdict::NotApplicable { "–".into() } else { rate(f) },
                std::iter::once(why(f))
                    .chain(
                        details(f)
                            .into_iter()
                            .map(|(label, text)| { format!("{label}: {}", once_per_router(&mut fixes, label, text)) })
                    )
                    .collect::<Vec<_>>()
                    .join("<br>")
                    .replace('|', "\\|")
            );
        }
        for v in &r.invariants {
            let _ = writeln!(
                out,
                "| `{}` | invariant | ❌ fail | – | – | {} |",
                crate::names::markdown(&r.router),
                v.replace('|', "\\|")
            );
        }
    }
    // The verdict in one line, for a reader of the step summary who skips the table.
    let leaking: Vec<String> = report.routers.iter().filter(|r| r.leaks()).map(|r| format!("`{}`", r.router)).collect();
    let _ = if leaking.is_empty() {
        writeln!(out, "\n✅ no leak found in {} router(s)", report.routers.len())
    } else {
        writeln!(out, "\n❌ {} of {} router(s) leak: {}", leaking.len(), report.routers.len(), leaking.join(", "))
    };
    if let Some(line) = latent_line(report) {
        let _ = writeln!(out, "\n⏳ {line}");
    }
    if let Some(line) = inconclusive_line(report) {
        let _ = writeln!(out, "\n❔ {line}");
    }
    out
}

/// The zoo: one row per router, a verdict column per probe, beside its load balance, then how
/// many leak (a broken invariant counts, as in [`Report::leaks`]).
pub(crate) fn render_zoo(report: &Report) -> String {
    let (routers, probes) = (&report.routers, &report.options.probes);
    let mut out = String::new();
    let width = router_width(report);
    let cell = verdict_width("LEAK ", routers.iter().flat_map(|r| r.findings.iter().map(|f| f.verdict)));
    let _ = write!(out, "{:<width$}", "router");
    for p in probes {
        let _ = write!(out, " {:<cell$}", p.to_string());
    }
    let _ = writeln!(out, " {:>8} {:>6}", "max/mean", "drop");
    for r in routers {
        let _ = write!(out, "{:<width$}", r.router);
        for p in probes {
            let v = r.finding(*p).map_or("-", |f| verdict_word(f.verdict));
            let _ = write!(out, " {v:<cell$}");
        }
        let _ = writeln!(out, " {:>8.3} {:>6}", r.load.max_over_mean_load, percent(r.load.drop_rate));
    }
    let leaking = routers.iter().filter(|r| r.leaks()).count();
    let _ = writeln!(
        out,
        "\n{leaking} of {} presets leak. LEAK = the probe changed some token's routing; see `moe-audit check <preset>` for rates and witnesses.",
        routers.len()
    );
    if let Some(line) = latent_line(report) {
        let _ = writeln!(out, "{line}.");
    }
    if let Some(line) = inconclusive_line(report) {
        let _ = writeln!(out, "{line}; inconclusive = within the router's randomness.");
    }
    out
}

/// The outcome of `replay`: the leak (capacity alone: latent; X: the drift) reproduced, with
/// the before and after routes, or gone.
pub(crate) fn render_replay(replay: &ReplayOutcome) -> String {
    let w = &replay.witness;
    let token = format!("batch {}, position {}", w.token_a.batch, w.token_a.pos);
    let found = verdict_word(replay.verdict()).to_uppercase();
    let gone = if w.probe == Probe::X { "no drift" } else { "no leak" };
    let name = w.name().unwrap_or_default();
    if replay.reproduces() {
        // The capacity in force is part of the record: said beside the routes when it changed.
        let capacity = |c: Option<usize>| match (replay.diff.capacity, c) {
            (false, _) => String::new(),
            (true, Some(c)) => format!(", capacity {c}"),
            (true, None) => ", no capacity".into(),
        };
        format!(
            "{found} reproduced: router {name}, probe {} ({}), property {}: token {token} routes differently ({})\n  before: {}{}\n  after:  {}{}\n",
            w.probe,
            w.probe.name(),
            w.property,
            replay.diff.describe(),
            crate::analyze::explain::routes(&replay.before),
            capacity(replay.capacity.0),
            crate::analyze::explain::routes(&replay.after),
            capacity(replay.capacity.1),
        )
    } else {
        format!("{gone}: router {name} now routes token {token} alike in both calls\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyze::{AuditOptions, RouterReport};
    use crate::routing::LoadStats;

    #[test]
    fn an_invariant_failure_alone_is_summarised_as_such() {
        let report = Report {
            options: AuditOptions { probes: Vec::new(), ..AuditOptions::default() },
            routers: vec![RouterReport {
                router: "switch-v1".into(),
                load: LoadStats::default(),
                invariants: vec!["group 0: expert 1 keeps 3 routes over its capacity 2".into()],
                findings: vec![Finding { verdict: Verdict::Pass, ..Finding::empty(Probe::P) }],
            }],
        };
        let text = render_text(&report, &|_, _| None);
        assert!(!text.contains("router(s) leak"), "{text}");
        assert!(
            text.ends_with("1 of 1 router(s) break an invariant while every probe passed: switch-v1 (a capacity per sequence must be stated with its scope: moe-audit/2)\n"),
            "{text}"
        );
    }

    #[test]
    fn columns_fit_long_router_names_and_the_inconclusive_word() {
        let finding = |probe, verdict| Finding { verdict, note: "why".into(), ..Finding::empty(probe) };
        let router = |name: &str| RouterReport {
            router: name.into(),
            load: LoadStats::default(),
            invariants: Vec::new(),
            findings: vec![finding(Probe::P, Verdict::Pass), finding(Probe::D, Verdict::Inconclusive)],
        };
        let report = Report {
            options: AuditOptions { probes: vec![Probe::P, Probe::D], ..AuditOptions::default() },
            routers: vec![router("hf-Glm4MoeLiteForCausalLM-layer-1"), router("short")],
        };
        let text = render_text(&report, &|_, _| None);
        let rows: Vec<&str> = text.lines().skip(1).take(5).collect();
        // Every column starts where the header's does, whatever the name's length.
        for column in ["probe", "verdict", "property"] {
            let at = rows[0].find(column).unwrap();
            for row in &rows[1..] {
                assert_eq!(&row[at - 1..at], " ", "{column} in {row:?}\n{text}");
                assert_ne!(&row[at..at + 1], " ", "{column} in {row:?}\n{text}");
            }
        }
        assert!(text.contains(" inconclusive ") && !text.contains("noise"), "{text}");
        let zoo = render_zoo(&report);
        let header = zoo.lines().next().unwrap();
        let row = zoo.lines().nth(1).unwrap();
        assert_eq!(header.find(" P ").unwrap(), row.find(" pass ").unwrap(), "{zoo}");
        assert_eq!(header.find(" D ").unwrap(), row.find(" inconclusive ").unwrap(), "{zoo}");
    }

    #[test]
    fn zero_point_zero_percent_never_stands_beside_a_changed_decision() {
        let finding = |verdict, affected, compared: usize| Finding {
            verdict,
            affected,
            compared,
            rate: affected as f64 / compared as f64,
            ..Finding::empty(Probe::P)
        };
        // DeepSpeed's top-2 gate served at eval_capacity_factor 2.0, 4 x 128 tokens: P leaked 3 of
        // 32512 tokens, R's capacity alone changed.
        assert_eq!(rate(&finding(Verdict::Leak, 3, 32512)), "<0.1%");
        assert_eq!(rate(&finding(Verdict::Latent, 0, 3456)), "0.0%");
        assert_eq!(rate(&finding(Verdict::Leak, 1, 2000)), "0.1%", "0.05% rounds to one decimal");
        assert_eq!(rate(&finding(Verdict::NotApplicable, 0, 1)), "-");
    }

    #[test]
    fn the_zoo_counts_a_broken_invariant_as_a_leak() {
        // No probe leaks, but an invariant fails: the router leaks (`RouterReport::leaks`), so
        // the zoo's count must say so too.
        let router = |name: &str, invariants: Vec<String>| RouterReport {
            router: name.into(),
            load: LoadStats::default(),
            invariants,
            findings: Vec::new(),
        };
        let report = Report {
            options: AuditOptions { probes: Vec::new(), ..AuditOptions::default() },
            routers: vec![router("ok", Vec::new()), router("broken", vec!["group 0: capacity".into()])],
        };
        assert!(report.routers[1].leaks());
        let zoo = render_zoo(&report);
        assert!(zoo.contains("\n1 of 2 presets leak."), "{zoo}");
    }

    #[test]
    fn a_capacity_only_change_is_said_as_such_in_the_table_and_the_replay() {
        // A capacity computed from the call's length (megatron-probs, factor 64) changes under P
        // before any decision does (tests/it/analyze.rs checks the verdict and the replay).
        use crate::analyze::{audit, Subject, Witness};
        let mut config = crate::config::preset("megatron-probs").unwrap().config().unwrap();
        config.capacity.as_mut().unwrap().factor = Some(64.0);
        let layer =
            crate::layer::MoeLayer::seeded(config, 32, 32, 0, candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap();
        let options = AuditOptions {
            probes: vec![Probe::P],
            batch: 4,
            seq_len: 32,
            trials: 16,
            seed: 0,
            ranks: 2,
            exhaustive: false,
        };
        let router = audit(&Subject::layer(&layer), &options, &crate::progress::Silent).unwrap();
        let table = render_text(&Report { options, routers: vec![router.clone()] }, &|_, _| None);
        assert!(!table.contains("LEAK"), "no decision changed: {table}");
        assert!(
            table.contains(" latent ") && table.contains("the capacity in force changed, no decision did"),
            "{table}"
        );
        assert!(
            table.contains("no leak found in 1 router(s)\n1 of 1 router(s) latent: megatron-probs (P): "),
            "{table}"
        );

        let witness = router.findings[0].witness.as_ref().expect("a witness of the capacity change");
        let path = std::env::temp_dir().join(format!("moe-audit-render-capacity-{}.json", std::process::id()));
        std::fs::write(&path, serde_json::to_string(witness).unwrap()).unwrap();
        let replay = Witness::read(&path).unwrap().replay(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let text = render_replay(&replay);
        assert!(text.starts_with("LATENT reproduced: router megatron-probs, probe P"), "{text}");
        assert!(text.contains("routes differently (capacity)\n  before: [") && text.contains(", capacity "), "{text}");
    }
}
