//! The routing record: every decision a router made for one call, complete and serde-stable.
//!
//! Field names are a public JSON contract (README, "The routing record"); probes compare these
//! records token by token, so nothing that decides an output may be left out.

use super::diff::OutputDtype;
use super::stats::{load_stats, ExpertLoad, LoadStats};
use crate::config::{Flatten, ScopeGroup};
use serde::{Deserialize, Serialize};

/// Every routing decision of one call over a `[batch, seq_len]` input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Routing {
    /// The router's name.
    pub router: String,
    /// Sequences in the call.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Number of experts E.
    pub experts: usize,
    /// Experts per token; `None` for expert choice.
    pub top_k: Option<usize>,
    /// Slots per expert over the whole call (the sum over scope groups); `None` when dropless.
    pub capacity: Option<Vec<usize>>,
    /// How the call was split into routing groups, and each group's capacity.
    pub scope: ScopeRecord,
    /// One entry per token, sequence-major: index `batch * seq_len + pos`.
    pub tokens: Vec<TokenRouting>,
    /// Per expert: routes before and after dropping.
    pub experts_load: Vec<ExpertLoad>,
    /// Load-balance summary.
    pub stats: LoadStats,
    /// The rank that routed each sequence, for a layer run expert-parallel (a router behind the
    /// protocol with `ranks`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Vec<usize>>,
    /// The layer's output rows, when the router sends them (protocol field `output`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<Outputs>,
}

/// The output rows of a layer's call, compared token by token within its dtype's tolerance
/// ([`OutputDtype::rtol`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outputs {
    /// The dtype the layer computes in (rows are sent as f32).
    pub dtype: OutputDtype,
    /// Values per row H.
    pub hidden: usize,
    /// `batch * seq_len * hidden` values, sequence-major.
    pub rows: Vec<f32>,
}

impl Outputs {
    /// The output row of flat token `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.rows[i * self.hidden..(i + 1) * self.hidden]
    }
}

/// The scope routing was computed in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScopeRecord {
    /// Grouping rule.
    pub group: GroupRule,
    /// Flattening order inside a group.
    pub flatten: Flatten,
    /// The groups, in order.
    pub groups: Vec<GroupRecord>,
}

/// The rule a record's routing groups were cut by: a config's scope group, or the ranks of a
/// layer run expert-parallel (each rank's tokens compete together, group r = rank r). `rank`
/// names records only: a router config's `[scope] group` stays a [`ScopeGroup`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum GroupRule {
    /// A config's grouping, written as the config writes it.
    Scope(ScopeGroup),
    /// One group per expert-parallel rank.
    Rank,
}

impl From<ScopeGroup> for GroupRule {
    fn from(g: ScopeGroup) -> Self {
        GroupRule::Scope(g)
    }
}

impl TryFrom<String> for GroupRule {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "rank" => Ok(GroupRule::Rank),
            _ => ScopeGroup::try_from(s.clone()).map(GroupRule::Scope).map_err(|_| {
                format!(
                    "unknown scope group `{}`, expected `batch`, `sequence`, `tokens:N` with N > 0, or `rank`",
                    crate::error::excerpt(&s)
                )
            }),
        }
    }
}

impl From<GroupRule> for String {
    fn from(g: GroupRule) -> String {
        g.to_string()
    }
}

impl std::fmt::Display for GroupRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GroupRule::Scope(g) => g.fmt(f),
            GroupRule::Rank => f.write_str("rank"),
        }
    }
}

/// One routing group: the tokens that competed together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// Tokens in the group.
    pub tokens: usize,
    /// Capacity of every expert in this group; `None` when dropless.
    pub capacity: Option<usize>,
}

/// The routes of one token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenRouting {
    /// Sequence index.
    pub batch: usize,
    /// Position in the sequence.
    pub pos: usize,
    /// Index into `scope.groups` of the group the token competed in.
    pub group: usize,
    /// Routes in choice order (1st choice first); padding slots last, by expert id.
    pub routes: Vec<Route>,
    /// The capacity in force for this token when it is not its group's: causal capacity `C(t)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<usize>,
}

/// One (token, expert) pair.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Route {
    /// Expert id.
    pub expert: usize,
    /// Combine weight when kept; for a dropped route, the gate it had before dropping (it
    /// contributes nothing); 0 for a padding slot.
    pub weight: f32,
    /// False when capacity dropped the route.
    pub kept: bool,
    /// True for a gate-0 padding slot added by pad-to-capacity.
    pub padded: bool,
}

/// What a router decided for one call: a record's fields before its load figures.
pub struct Decisions {
    /// The router's name.
    pub router: String,
    /// Sequences in the call.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Real experts (null-expert slots left out).
    pub experts: usize,
    /// k of a token-choice router; `None` for expert choice.
    pub top_k: Option<usize>,
    /// Each routing group's capacity per expert; `None` without a capacity.
    pub capacity: Option<Vec<usize>>,
    /// How the call was split into routing groups.
    pub scope: ScopeRecord,
    /// Every token's routes, in flattening order.
    pub tokens: Vec<TokenRouting>,
}

impl Routing {
    /// The one builder of a record (built-in routing, the external protocol, the expert-parallel
    /// gather): the expert loads counted from the tokens and, given `softmax` (every token's
    /// softmax row, concatenated; empty: no probabilities, aux loss 0), the load statistics.
    /// Without it they stay zero, for records only compared route by route.
    pub fn assemble(d: Decisions, softmax: Option<&[f32]>) -> Routing {
        let experts_load = loads(d.experts, &d.tokens);
        let stats = match softmax {
            // A row is as wide as the logits: null experts' columns (past `experts`) are ignored.
            Some(rows) => load_stats(&experts_load, rows.chunks_exact((rows.len() / d.tokens.len().max(1)).max(1))),
            None => LoadStats::default(),
        };
        Routing {
            router: d.router,
            batch: d.batch,
            seq_len: d.seq_len,
            experts: d.experts,
            top_k: d.top_k,
            capacity: d.capacity,
            scope: d.scope,
            tokens: d.tokens,
            experts_load,
            stats,
            placement: None,
            output: None,
        }
    }

    /// The routes of token `pos` of sequence `batch`.
    pub fn token(&self, batch: usize, pos: usize) -> &TokenRouting {
        &self.tokens[batch * self.seq_len + pos]
    }

    /// Kept routes of every expert as `(flat token index, weight)`, in token order; padding
    /// slots included (weight 0). This is what dispatch sends to each expert.
    pub fn expert_rows(&self) -> Vec<Vec<(usize, f32)>> {
        let mut rows = vec![Vec::new(); self.experts];
        for (i, t) in self.tokens.iter().enumerate() {
            for r in t.routes.iter().filter(|r| r.kept) {
                rows[r.expert].push((i, r.weight));
            }
        }
        rows
    }
}

/// Routes per expert before and after dropping.
fn loads(experts: usize, tokens: &[TokenRouting]) -> Vec<ExpertLoad> {
    let mut loads: Vec<ExpertLoad> =
        (0..experts).map(|expert| ExpertLoad { expert, routed: 0, kept: 0, padded: 0 }).collect();
    for r in tokens.iter().flat_map(|t| &t.routes) {
        let l = &mut loads[r.expert];
        if r.padded {
            l.padded += 1;
        } else {
            l.routed += 1;
            l.kept += usize::from(r.kept);
        }
    }
    loads
}
