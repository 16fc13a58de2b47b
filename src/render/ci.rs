//! CI report formats: JUnit XML (one test case per router × probe, a leak's witness summary as
//! the failure message) and GitHub Actions `::error::` annotations, one per leak; a latent
//! dependence is a failure too, as the default `--fail-on` counts it.

use super::text::{details, verdict_word, why};
use crate::analyze::{Finding, Report, Verdict};
use crate::routing::Route;
use std::fmt::Write;

/// One line on a leak: the witness's token and what changed, or the rate and where; then the
/// explanation (calls, change, fix).
fn summary(f: &Finding) -> String {
    let mut out = headline(f);
    for (label, text) in details(f) {
        let _ = write!(out, "; {label}: {text}");
    }
    out
}

fn headline(f: &Finding) -> String {
    let verb = match f.verdict {
        Verdict::Drift => "drifts in",
        Verdict::Latent => "is latent in",
        _ => "leaks",
    };
    let rate = format!("{} of {} tokens changed ({:.1}%)", f.affected, f.compared, f.rate * 100.0);
    match &f.witness {
        Some(w) => format!(
            "{} {} {verb} {}: {rate}; witness: token batch {}, position {} routes differently ({}): before {} after {}",
            f.probe,
            f.probe.name(),
            f.property,
            w.token_a.batch,
            w.token_a.pos,
            w.differs,
            routes(&w.before.routes),
            routes(&w.after.routes),
        ),
        None => format!("{} {} {verb} {}: {rate}; {}", f.probe, f.probe.name(), f.property, why(f)),
    }
}

/// `[e6 0.6496, e3 0.3504 dropped]`.
fn routes(routes: &[Route]) -> String {
    let one = |r: &Route| {
        format!(
            "e{} {:.4}{}",
            r.expert,
            r.weight,
            if r.padded {
                " padding"
            } else if r.kept {
                ""
            } else {
                " dropped"
            }
        )
    };
    format!("[{}]", routes.iter().map(one).collect::<Vec<_>>().join(", "))
}

use crate::names::xml;

/// JUnit XML: a test suite per router, a test case per probe (leak, latent = failure, not applicable =
/// skipped) and one for the invariants.
pub(crate) fn render_junit(report: &Report) -> String {
    let count = |v: Verdict| report.routers.iter().flat_map(|r| &r.findings).filter(|f| f.verdict == v).count();
    let broken = report.routers.iter().filter(|r| !r.invariants.is_empty()).count();
    let tests: usize = report.routers.iter().map(|r| r.findings.len() + 1).sum();
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        out,
        "<testsuites name=\"moe-audit\" tests=\"{tests}\" failures=\"{}\" skipped=\"{}\">",
        count(Verdict::Leak) + count(Verdict::Latent) + count(Verdict::Inconclusive) + broken,
        count(Verdict::NotApplicable)
    );
    for r in &report.routers {
        let failures = (r.findings.iter())
            .filter(|f| matches!(f.verdict, Verdict::Leak | Verdict::Latent | Verdict::Inconclusive))
            .count()
            + usize::from(!r.invariants.is_empty());
        let skipped = r.findings.iter().filter(|f| f.verdict == Verdict::NotApplicable).count();
        let name = xml(&r.router);
        let _ = writeln!(
            out,
            "  <testsuite name=\"{name}\" tests=\"{}\" failures=\"{failures}\" skipped=\"{skipped}\">",
            r.findings.len() + 1
        );
        for f in &r.findings {
            let case = xml(&format!("{} {} ({})", f.probe, f.probe.name(), f.property));
            let _ = write!(out, "    <testcase classname=\"moe-audit.{name}\" name=\"{case}\"");
            match f.verdict {
                Verdict::Pass => out.push_str("/>\n"),
                // Drift is reported, not failed: `--fail-on drift` gates on it by the exit code.
                Verdict::Drift => {
                    let _ = writeln!(out, ">\n      <system-out>{}</system-out>\n    </testcase>", xml(&summary(f)));
                }
                Verdict::NotApplicable => {
                    let _ = writeln!(out, ">\n      <skipped message=\"{}\"/>\n    </testcase>", xml(&f.note));
                }
                // A random router fails the gate: the probe cannot vouch for it.
                Verdict::Inconclusive => {
                    let _ = writeln!(
                        out,
                        ">\n      <failure type=\"inconclusive\" message=\"{}\">{}</failure>\n    </testcase>",
                        xml(&f.note),
                        xml(&f.note)
                    );
                }
                // A latent dependence fails as a leak does (the default `--fail-on leak,latent`).
                Verdict::Leak | Verdict::Latent => {
                    let _ = writeln!(
                        out,
                        ">\n      <failure type=\"{}\" message=\"{}\">{}</failure>\n    </testcase>",
                        if f.verdict == Verdict::Leak { "leak" } else { "latent" },
                        xml(&summary(f)),
                        xml(&format!("{} {}: {}", verdict_word(f.verdict), f.note, why(f)))
                    );
                }
            }
        }
        let _ = write!(out, "    <testcase classname=\"moe-audit.{name}\" name=\"invariants\"");
        if r.invariants.is_empty() {
            out.push_str("/>\n");
        } else {
            let _ = writeln!(
                out,
                ">\n      <failure type=\"invariant\" message=\"{}\">{}</failure>\n    </testcase>",
                xml(&r.invariants[0]),
                xml(&r.invariants.join("\n"))
            );
        }
        out.push_str("  </testsuite>\n");
    }
    out.push_str("</testsuites>\n");
    out
}

/// GitHub's escaping of a workflow command's message (`%`, CR, LF) and properties (also `:`, `,`).
fn escape(s: &str, property: bool) -> String {
    let s = s.replace('%', "%25").replace('\r', "%0D").replace('\n', "%0A");
    if property {
        s.replace(':', "%3A").replace(',', "%2C")
    } else {
        s
    }
}

/// `::error title=...::message` per leak, latent finding and invariant failure.
pub(crate) fn render_github(report: &Report) -> String {
    let mut out = String::new();
    for r in &report.routers {
        for f in r.findings.iter().filter(|f| matches!(f.verdict, Verdict::Leak | Verdict::Latent)) {
            let verb = if f.verdict == Verdict::Leak { "leaks" } else { "is latent" };
            let title = format!("moe-audit: {} {verb} on {} {}", r.router, f.probe, f.probe.name());
            let _ = writeln!(
                out,
                "::error title={}::{}",
                escape(&title, true),
                escape(&format!("{}: {}", r.router, summary(f)), false)
            );
        }
        for f in r.findings.iter().filter(|f| f.verdict == Verdict::Inconclusive) {
            let title = format!("moe-audit: {} inconclusive on {} {}", r.router, f.probe, f.probe.name());
            let _ = writeln!(
                out,
                "::error title={}::{}",
                escape(&title, true),
                escape(&format!("{}: {}", r.router, f.note), false)
            );
        }
        for f in r.findings.iter().filter(|f| f.verdict == Verdict::Drift) {
            let title = format!("moe-audit: {} drifts in low precision", r.router);
            let _ = writeln!(
                out,
                "::warning title={}::{}",
                escape(&title, true),
                escape(&format!("{}: {}", r.router, summary(f)), false)
            );
        }
        for v in &r.invariants {
            let title = format!("moe-audit: {} breaks an invariant", r.router);
            let _ = writeln!(
                out,
                "::error title={}::{}",
                escape(&title, true),
                escape(&format!("{}: {v}", r.router), false)
            );
        }
    }
    out
}
