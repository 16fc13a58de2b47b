//! A leak in words, for a reader who does not know the probes: which two calls were compared,
//! the first affected token, what changed for it (with values), how far the cause was, and how
//! to fix this class of leak given the router's design. Every report format prints the same
//! [`Explanation`]; it is computed once, here, from the finding and the router's configuration.

use super::probe::Modes;
use super::witness::TokenRef;
use super::{AuditOptions, Finding, Probe, Verdict};
use crate::mode::Mode;
use moe_audit_core::config::{Family, RouterConfig};
use moe_audit_core::routing::{Route, TokenRouting};
use serde::{Deserialize, Serialize};

/// What a leaking probe means and what to do about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Explanation {
    /// The affected token the witness was shrunk for, in the witness's call `a` (the finding's
    /// `first_position` is the smallest affected position of the audit's own calls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<TokenRef>,
    /// The two calls compared, reference first: e.g. "the sequence of 5 tokens" and "its prefix
    /// of 2 tokens".
    pub calls: [String; 2],
    /// What changed for the token, with values (none when the router has no configuration to
    /// build a witness from, e.g. an external router).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed: Option<String>,
    /// Where the cause was, in words: "a token 1 position later", "another sequence", ...
    pub cause: String,
    /// How to fix this class of leak, from the router's design, with the committed sweep's
    /// figures for the suggested alternative where it has them.
    pub fix: String,
}

/// The explanation of a leak, a latent dependence or a drift (none for a pass or a probe that
/// does not apply).
/// `audited_in`: the mode the router is audited in (serving: M's calls are inference, then
/// training).
pub(crate) fn explain(
    f: &Finding,
    options: &AuditOptions,
    config: Option<&RouterConfig>,
    audited_in: Mode,
) -> Option<Explanation> {
    if !matches!(f.verdict, Verdict::Leak | Verdict::Latent | Verdict::Drift) {
        return None;
    }
    let w = f.witness.as_ref();
    Some(Explanation {
        token: w.map(|w| w.token_a),
        calls: f.probe.rule().calls(w, options, modes(config, audited_in)),
        changed: w.map(|w| changed(&w.differs, &w.before, &w.after)),
        cause: cause(f),
        fix: fix(f.probe, config),
    })
}

/// Where the router's modes come from: its configuration, or (an external router) the mode
/// it is audited in.
fn modes(config: Option<&RouterConfig>, audited_in: Mode) -> Modes {
    match config {
        Some(_) => Modes::Config,
        None => Modes::External(audited_in),
    }
}

pub(crate) fn plural(n: usize, one: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {one}s")
    }
}

/// `e6 0.6496` or `e3 0.3504 dropped`.
fn route(r: &Route) -> String {
    let state = if r.padded {
        " padding"
    } else if r.kept {
        ""
    } else {
        " dropped"
    };
    format!("e{} {:.4}{state}", r.expert, r.weight)
}

/// `[e6 0.6496, e3 0.3504 dropped]`, or `none`.
fn list(rs: &[Route]) -> String {
    match rs {
        [] => "none".to_string(),
        _ => format!("[{}]", rs.iter().map(route).collect::<Vec<_>>().join(", ")),
    }
}

/// A token's own routes (padding slots left out).
fn own(t: &TokenRouting) -> Vec<Route> {
    t.routes.iter().filter(|r| !r.padded).copied().collect()
}

/// A token's routes as the report writes them: `[e6 0.6496, e3 0.3504 dropped]`.
pub fn routes(t: &TokenRouting) -> String {
    list(&own(t))
}

/// What changed for a token, route by route when the experts are the same.
fn changed(differs: &str, before: &TokenRouting, after: &TokenRouting) -> String {
    let (x, y) = (own(before), own(after));
    let mut parts = Vec::new();
    if x.iter().map(|r| r.expert).ne(y.iter().map(|r| r.expert)) {
        parts.push(format!("experts {} -> {}", list(&x), list(&y)));
    } else {
        for (p, q) in x.iter().zip(&y) {
            if p.kept != q.kept {
                let word = |kept| if kept { "kept" } else { "dropped" };
                parts.push(format!("expert {} {} -> {}", p.expert, word(p.kept), word(q.kept)));
            }
            if (p.weight - q.weight).abs() > moe_audit_core::routing::WEIGHT_TOLERANCE {
                parts.push(format!("weight of expert {} {:.4} -> {:.4}", p.expert, p.weight, q.weight));
            }
        }
    }
    if differs.contains("padding") {
        parts.push("padding slots differ".into());
    }
    match (before.capacity, after.capacity) {
        (Some(c), Some(d)) if c != d => parts.push(format!("capacity {c} -> {d}")),
        _ if differs.contains("capacity") => parts.push("the capacity in force changed".into()),
        _ => {}
    }
    if parts.is_empty() {
        parts.push(format!("{differs} changed"));
    }
    parts.join("; ")
}

/// The nearest same-sequence cause (P, F), exact when its bucket holds one distance.
pub(crate) fn positions_later(f: &Finding) -> Option<String> {
    let b = f.influence.first()?;
    Some(if b.from == b.to {
        format!("{} later", plural(b.from, "position"))
    } else {
        format!("{} to {} positions later", b.from, b.to)
    })
}

/// Where the cause was, in words.
fn cause(f: &Finding) -> String {
    f.probe.rule().cause(f)
}

/// Where the figures below come from.
const SWEEP: &str = "docs/sweep/sweep.md, 4x64 tokens, 8 experts";

/// How to fix: the probe's own fix, or else the design family's.
fn fix(probe: Probe, config: Option<&RouterConfig>) -> String {
    if let Some(fix) = probe.rule().fix() {
        return fix;
    }
    let Some(config) = config else {
        return "token t's routing must depend only on tokens <= t of its own sequence: dropless token choice, or capacity per sequence kept by position".into();
    };
    let k = config.top_k().unwrap_or(1).min(2);
    // Figures of the committed sweep at the same k (k 2 stands for k >= 2).
    let (dropless, causal_drop, cf2) =
        if k == 1 { ("1.406", "14.8", "2.0% under N") } else { ("1.234", "6.8", "0.1% under P") };
    match Family::of(config) {
        Family::BatchCapacity => format!(
            "capacity is shared by the whole batch (or rank), so later tokens and other sequences compete for this token's slot: \
             go dropless, or keep capacity per sequence by position (causal capacity); raising cf only makes overflow rarer \
             ({SWEEP}, k={k}: dropless mixtral leaks 0.0% at max/mean load {dropless}; causal-capacity at cf 1.25 leaks 0.0% and drops {causal_drop}%; \
             megatron-probs at cf 2 still changes {cf2})"
        ),
        Family::ExpertChoice => format!(
            "experts choose tokens over the whole batch, which no decoder can do at inference: use token choice, dropless or with capacity \
             per sequence ({SWEEP}: expert-choice changes 9.7% of tokens under P at cf 1 with max/mean load 1.000; \
             dropless mixtral k=2 leaks 0.0% at max/mean load 1.234)"
        ),
        Family::Balanced => format!(
            "balanced assignment over the batch is not causal: use top-k token choice with aux-loss-free bias balancing \
             ({SWEEP}, k=2: aux-loss-free leaks 0.0% at max/mean load 1.109; sinkhorn changes 9.4% under P at 1.156)"
        ),
        Family::SequenceCapacity | Family::Dropless | Family::ExpertThreshold => {
            "token t's routing must depend only on tokens <= t of its own sequence: look for state shared across tokens \
             (a capacity, a bias, a sort) in the router's custom code"
                .into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyze::InfluenceBucket;

    fn token(routes: &[(usize, f32, bool)], capacity: Option<usize>) -> TokenRouting {
        let routes =
            routes.iter().map(|&(expert, weight, kept)| Route { expert, weight, kept, padded: false }).collect();
        TokenRouting { batch: 0, pos: 0, group: 0, routes, capacity }
    }

    #[test]
    fn changes_are_said_route_by_route_with_values() {
        let before = token(&[(6, 0.73, true), (3, 0.27, true)], Some(4));
        let after = token(&[(6, 1.0, true), (3, 0.27, false)], Some(3));
        assert_eq!(
            changed("kept, weight, capacity", &before, &after),
            "weight of expert 6 0.7300 -> 1.0000; expert 3 kept -> dropped; capacity 4 -> 3"
        );
        let none = token(&[], None);
        assert_eq!(
            changed("experts, capacity", &before, &none),
            "experts [e6 0.7300, e3 0.2700] -> none; the capacity in force changed"
        );
    }

    #[test]
    fn the_cause_is_a_distance_in_words_and_only_for_p_and_f() {
        let mut f = Finding::empty(Probe::F);
        f.influence = vec![InfluenceBucket { from: 1, to: 1, count: 3 }];
        assert_eq!(cause(&f), "a token 1 position later changed");
        f.influence = vec![InfluenceBucket { from: 2, to: 3, count: 1 }];
        assert_eq!(cause(&f), "a token 2 to 3 positions later changed");
        f.probe = Probe::R;
        assert_eq!(cause(&f), "the batch re-ordered, resized or re-padded", "R has no distance");
    }

    #[test]
    fn the_fix_follows_the_design_family() {
        let megatron = moe_audit_core::config::preset("megatron-probs").unwrap().config().unwrap();
        assert!(fix(Probe::N, Some(&megatron)).starts_with("capacity is shared by the whole batch"));
        let ec = moe_audit_core::config::preset("expert-choice").unwrap().config().unwrap();
        assert!(fix(Probe::P, Some(&ec)).contains("use token choice"));
        assert!(fix(Probe::D, Some(&ec)).starts_with("random only in training"), "D's fix is the probe's");
        assert!(fix(Probe::P, None).contains("tokens <= t of its own sequence"), "an external router");
    }

    /// The fixes quote the committed sweep: every figure they cite must be that table's, so a
    /// regenerated sweep that moves one fails here instead of leaving the advice stale.
    #[test]
    fn the_cited_figures_are_the_committed_sweeps() {
        let table = include_str!("../../../../docs/sweep/sweep.md");
        let mut lines = table.lines().filter(|l| l.starts_with('|'));
        let cells = |l: &'static str| l.split('|').map(str::trim).skip(1).collect::<Vec<_>>();
        let header = cells(lines.next().expect("a header"));
        let rows: Vec<Vec<&str>> = lines.skip(1).map(cells).collect();
        let value = |router: &str, cf: &str, k: &str, column: &str| -> String {
            let c = header.iter().position(|h| *h == column).expect(column);
            let row = rows.iter().find(|r| r[0] == router && r[1] == cf && r[2] == k);
            row.unwrap_or_else(|| panic!("no row {router} cf {cf} k {k}"))[c].to_string()
        };
        let cited = [
            ("mixtral", "–", "1", "max/mean routed", "1.406"),
            ("mixtral", "–", "2", "max/mean routed", "1.234"),
            ("mixtral", "–", "2", "P %", "0.0"),
            ("causal-capacity", "1.25", "1", "drop %", "14.8"),
            ("causal-capacity", "1.25", "2", "drop %", "6.8"),
            ("causal-capacity", "1.25", "2", "P %", "0.0"),
            ("megatron-probs", "2", "1", "N %", "2.0"),
            ("megatron-probs", "2", "2", "P %", "0.1"),
            ("expert-choice", "1", "–", "P %", "9.7"),
            ("expert-choice", "1", "–", "max/mean routed", "1.000"),
            ("aux-loss-free", "–", "2", "max/mean routed", "1.109"),
            ("sinkhorn", "–", "2", "P %", "9.4"),
            ("sinkhorn", "–", "2", "max/mean routed", "1.156"),
        ];
        for (router, cf, k, column, figure) in cited {
            assert_eq!(value(router, cf, k, column), figure, "{router} cf {cf} k {k}: {column}");
        }
    }
}
