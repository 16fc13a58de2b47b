//! An engine audit as a page: the servers, one row per axis, then each axis that was compared
//! as a records comparison (the sections of `routes compare`'s page).

use super::page::{badge, esc, page};
use super::routes::routes_sections;
use crate::engine::Report;
use crate::render::engine::{axis_note, axis_verdict};
use std::fmt::Write;

/// The report as one HTML document.
pub(crate) fn engine_html(r: &Report) -> String {
    let mut b = String::from("<h1>moe-audit engine</h1>\n");
    let _ = writeln!(
        b,
        "<p class=\"sub\">{} {} at {}, model {}</p>",
        esc(r.server.engine.name()),
        esc(&r.server.version),
        esc(&r.server.url),
        esc(&r.server.model)
    );
    let _ = writeln!(
        b,
        "<div class=\"summary {}\">{}</div>",
        if r.failed { "leak" } else { "pass" },
        if r.failed { "an axis that must hold changed" } else { "every axis that must hold held" }
    );
    b.push_str("<table><tr><th>axis</th><th>what</th><th>decisions</th><th>changed</th><th>one-slot</th><th>diverged</th><th>verdict</th></tr>\n");
    for a in &r.axes {
        let class = if a.held() {
            "pass"
        } else if a.must_hold {
            "leak"
        } else {
            "na"
        };
        let _ = writeln!(
            b,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} ({:.3}%)</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            a.axis.name(),
            esc(a.axis.about()),
            a.decisions,
            a.changed,
            100.0 * a.share(),
            a.one_slot,
            a.diverged.len(),
            badge(class, axis_verdict(a))
        );
    }
    b.push_str("</table>\n");
    for a in &r.axes {
        let _ = writeln!(b, "<h2>{}: {}</h2>", a.axis.name(), esc(a.axis.about()));
        if let Some(note) = axis_note(a) {
            let _ = writeln!(b, "<p>{}</p>", esc(&note));
        }
        if let Some(c) = &a.comparison {
            b.push_str(&routes_sections(c));
        }
    }
    page(&format!("moe-audit engine: {}", r.server.url), &b)
}
