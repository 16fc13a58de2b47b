//! A compact, stable text rendering of a [`Routing`], for terminals and snapshot tests.
//! Weights are printed with 4 decimals so float noise far below that cannot churn snapshots.

use super::Routing;
use std::fmt::Write;

/// Renders the record: a header, one row per token, then the expert loads and the stats.
pub fn render_table(r: &Routing) -> String {
    let mut out = String::new();
    let k = r.top_k.map_or("expert choice".to_string(), |k| format!("top-{k}"));
    let groups = &r.scope.groups;
    let cap = match groups.first().and_then(|g| g.capacity) {
        None => "dropless".to_string(),
        Some(c) if groups.iter().all(|g| g.capacity == Some(c)) => format!("capacity {c} per expert per group"),
        Some(_) => {
            format!("capacity per group {:?}", groups.iter().map(|g| g.capacity.unwrap_or(0)).collect::<Vec<_>>())
        }
    };
    let _ = writeln!(
        out,
        "router {} | batch {} x seq {} | {} experts, {k} | scope {} ({} groups), {} | {cap}",
        r.router,
        r.batch,
        r.seq_len,
        r.experts,
        r.scope.group,
        groups.len(),
        r.scope.flatten
    );
    let _ = writeln!(out, "  b  pos  routes in choice order (x dropped, p padding slot)");
    for t in &r.tokens {
        let _ = write!(out, "{:>3} {:>4} ", t.batch, t.pos);
        if t.routes.is_empty() {
            out.push_str(" -");
        }
        for route in &t.routes {
            let mark = if route.padded {
                "p"
            } else if route.kept {
                " "
            } else {
                "x"
            };
            let _ = write!(out, " e{:<3} {:.4}{mark}", route.expert, route.weight);
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
    }
    let _ = writeln!(out, "expert  routed  kept  padded");
    let mut idle = 0;
    for l in &r.experts_load {
        if l.routed + l.padded == 0 {
            idle += 1;
            continue;
        }
        let _ = writeln!(out, "{:>6} {:>7} {:>5} {:>7}", l.expert, l.routed, l.kept, l.padded);
    }
    if idle > 0 {
        let _ = writeln!(out, "({idle} idle experts not shown)");
    }
    let s = &r.stats;
    let _ = writeln!(
        out,
        "max/mean load {:.3} | load cv {:.3} | drop rate {:.3} | aux loss {:.3}",
        s.max_over_mean_load, s.load_cv, s.drop_rate, s.aux_loss
    );
    out
}
