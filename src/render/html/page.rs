//! The page every HTML report shares: one self-contained document (style inline, no script, no
//! font or image fetched), its escaping, and the small pieces the reports repeat (verdict
//! badges, tables, shares).

use crate::analyze::Verdict;
use std::fmt::Write;

/// The style sheet, inline: system fonts only, colours that print.
const STYLE: &str = "
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0 auto;padding:16px 24px;max-width:1400px;color:#1b1f24;background:#fff}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}p.sub{color:#57606a;margin:2px 0 10px}
table{border-collapse:collapse;margin:6px 0}th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.n{text-align:right;font-variant-numeric:tabular-nums}
.v{display:inline-block;padding:0 7px;border-radius:9px;font-weight:600;font-size:12px;white-space:nowrap}
.pass{background:#dafbe1;color:#116329}.leak{background:#ffebe9;color:#a40e26}.drift{background:#fff8c5;color:#7d4e00}
.na{background:#eaeef2;color:#57606a}.inconclusive{background:#fbefff;color:#6e40c9}.latent{background:#fff1e5;color:#953800}
.summary{font-size:16px;font-weight:600;margin:10px 0;padding:8px 12px;border-radius:6px}
.row{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}.grow{flex:1 1 640px;min-width:0}
.card{border:1px solid #d0d7de;border-radius:6px;padding:8px 12px;margin:8px 0}
.details{color:#424a53;font-size:13px}.details b{color:#1b1f24}
.mono{font-family:ui-monospace,'DejaVu Sans Mono',Menlo,monospace;font-size:12px}
.legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px;border:1px solid #8c959f}
svg{display:block;margin:4px 0}svg text{font:11px system-ui,sans-serif;fill:#1b1f24}
.scroll{overflow-x:auto}
";

/// Text for HTML, in an element or an attribute: markup escaped, control characters replaced.
pub(super) fn esc(text: &str) -> String {
    crate::names::xml(text)
}

/// A whole document: `title` escaped, `body` already HTML.
pub(super) fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">\n<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}</body>\n</html>\n",
        esc(title)
    )
}

/// A verdict's class and word (the text report's words).
pub(super) fn verdict_badge(v: Verdict) -> String {
    let class = match v {
        Verdict::Pass => "pass",
        Verdict::Leak => "leak",
        Verdict::Latent => "latent",
        Verdict::NotApplicable => "na",
        Verdict::Inconclusive => "inconclusive",
        Verdict::Drift => "drift",
    };
    badge(class, super::super::text::verdict_word(v))
}

/// A coloured word: `class` one of the style's verdict classes.
pub(super) fn badge(class: &str, word: &str) -> String {
    format!("<span class=\"v {class}\">{}</span>", esc(word))
}

/// `x` (a share) as a percentage with `digits` decimals.
pub(super) fn pct(x: f64, digits: usize) -> String {
    format!("{:.digits$}%", 100.0 * x)
}

/// A table: header cells, then rows of cells already HTML (a cell starting with `=` is a
/// number, right-aligned).
pub(super) fn table(out: &mut String, header: &[&str], rows: impl IntoIterator<Item = Vec<String>>) {
    out.push_str("<table><thead><tr>");
    for h in header {
        let _ = write!(out, "<th>{}</th>", esc(h));
    }
    out.push_str("</tr></thead><tbody>\n");
    for row in rows {
        out.push_str("<tr>");
        for cell in row {
            match cell.strip_prefix('=') {
                Some(n) => write!(out, "<td class=\"n\">{n}</td>"),
                None => write!(out, "<td>{cell}</td>"),
            }
            .expect("a String takes every write");
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</tbody></table>\n");
}

/// A legend: (colour, label) swatches.
pub(super) fn legend(items: &[(&str, &str)]) -> String {
    let mut out = String::from("<p class=\"legend\">");
    for (colour, label) in items {
        let _ = write!(out, "<span><i class=\"sw\" style=\"background:{colour}\"></i>{}</span>", esc(label));
    }
    out.push_str("</p>\n");
    out
}
