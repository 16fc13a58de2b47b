//! Routing: from a `[batch, seq_len, experts]` score matrix to a [`Routing`] record.
//!
//! The assignment stage is pure host code over `f32` logits: exact, deterministic and the same
//! on every device. Scopes split the call into groups (`scope.rs`); each group is routed by token
//! choice, expert choice or expert threshold; capacity and dropping live in [`capacity`].
//! Two records are compared token by token with [`diff_token`] (`diff.rs`).

pub mod balance;
pub mod capacity;
mod diff;
mod expert_choice;
mod kind;
mod prefix;
mod record;
pub mod scope;
pub mod scores;
mod sinkhorn;
pub(crate) mod stats;
mod table;
pub mod threshold;
mod token_choice;

pub use diff::{capacity_of, diff_token, OutputDtype, TokenDiff, WEIGHT_TOLERANCE};
pub use kind::StepBatch;
pub use prefix::prefix_stable;
pub use record::Decisions;
pub use record::{GroupRecord, GroupRule, Outputs, Route, Routing, ScopeRecord, TokenRouting};
pub use stats::{ExpertLoad, LoadStats};
pub use table::render_table;

use crate::config::{PaddingMask, RouterConfig, ScoreFn};
use crate::error::{Error, Result};
use ndarray::{ArrayView2, ArrayView3};

/// Host-side logits of one call, `[batch, seq_len, experts]`.
pub type Logits = ndarray::Array3<f32>;

/// The routes of one group's tokens (in group order) and the group's capacity.
pub(crate) struct GroupRouting {
    pub routes: Vec<Vec<Route>>,
    pub capacity: Option<usize>,
    /// Per token, the capacity in force when it differs from the group's (causal capacity).
    pub in_force: Option<Vec<usize>>,
}

/// Routes a whole call: the assignment stage of every built-in router.
///
/// # Shapes
/// `logits`: `[batch, seq_len, experts]`, finite.
pub fn assign(config: &RouterConfig, logits: ArrayView3<f32>) -> Result<Routing> {
    assign_masked(config, logits, None)
}

/// [`assign`] with a padding mask (`true` = padding), for routers whose config declares
/// `padding_mask`: with `exclude`, padding tokens get no routes and do not count toward capacity;
/// with `compete`, they are routed like any token.
///
/// # Shapes
/// `logits`: `[batch, seq_len, experts]`; `padding`: `[batch, seq_len]`.
pub fn assign_masked(
    config: &RouterConfig,
    logits: ArrayView3<f32>,
    padding: Option<ArrayView2<bool>>,
) -> Result<Routing> {
    assign_with(config, logits, padding, true)
}

/// [`assign_masked`] for comparing routes only: the same record with `stats` left at zero. The
/// load statistics take every row's softmax (for a softmax-post or sigmoid router the only one)
/// and are about a third of an assignment; the analyzer's probes compare routes and never read
/// them.
pub fn assign_routes(
    config: &RouterConfig,
    logits: ArrayView3<f32>,
    padding: Option<ArrayView2<bool>>,
) -> Result<Routing> {
    assign_with(config, logits, padding, false)
}

fn assign_with(
    config: &RouterConfig,
    logits: ArrayView3<f32>,
    padding: Option<ArrayView2<bool>>,
    with_stats: bool,
) -> Result<Routing> {
    let (batch, seq_len, experts) = logits.dim();
    if let Some(mask) = &padding {
        if config.padding_mask.is_none() {
            return Err(Error::shape(
                &format!("router `{}`", config.name),
                "the router takes no padding mask (set `padding_mask`)".to_string(),
            ));
        }
        if mask.dim() != (batch, seq_len) {
            return Err(Error::shape(
                &format!("router `{}`", config.name),
                format!("padding mask is {:?}, logits are [{batch}, {seq_len}, {experts}]", mask.dim()),
            ));
        }
    }
    let excluded = |i: usize| {
        config.padding_mask == Some(PaddingMask::Exclude)
            && padding.as_ref().is_some_and(|m| m[[i / seq_len, i % seq_len]])
    };
    if experts != config.experts {
        return Err(Error::shape(
            &format!("router `{}`", config.name),
            format!("logits have {experts} experts per token, the router has {}", config.experts),
        ));
    }
    if batch == 0 || seq_len == 0 {
        return Err(Error::shape(
            &format!("router `{}`", config.name),
            format!("empty input: batch {batch}, seq_len {seq_len}"),
        ));
    }
    scores::check_finite(&logits)?;
    let logits = logits.as_standard_layout();
    let flat = logits.as_slice().expect("standard layout is contiguous");
    let softmax = if with_stats || config.score == ScoreFn::SoftmaxPre {
        scores::softmax_rows(flat, experts)
    } else {
        Vec::new()
    };
    let row = |i: usize| scores::Row {
        logits: &flat[i * experts..(i + 1) * experts],
        softmax: softmax.get(i * experts..(i + 1) * experts).unwrap_or_default(),
    };

    let mut tokens: Vec<TokenRouting> = (0..batch * seq_len)
        .map(|i| TokenRouting { batch: i / seq_len, pos: i % seq_len, group: 0, routes: Vec::new(), capacity: None })
        .collect();
    let mut groups = Vec::new();
    for (g, mut members) in scope::groups(&config.scope, batch, seq_len).into_iter().enumerate() {
        members.retain(|&i| !excluded(i));
        let rows: Vec<scores::Row> = members.iter().map(|&i| row(i)).collect();
        let routed = config.kind.rule().route_group(config, &rows);
        for (n, (&i, routes)) in members.iter().zip(routed.routes).enumerate() {
            tokens[i].group = g;
            tokens[i].routes = routes;
            tokens[i].capacity = routed.in_force.as_ref().map(|c| c[n]);
        }
        groups.push(GroupRecord { tokens: members.len(), capacity: routed.capacity });
    }

    let capacity = config.capacity.as_ref().map(|_| {
        let total: usize = groups.iter().filter_map(|g| g.capacity).sum();
        vec![total; config.real_experts()]
    });
    let decisions = Decisions {
        router: config.name.clone(),
        batch,
        seq_len,
        // Null experts compute nothing and are not in the record.
        experts: config.real_experts(),
        top_k: config.top_k(),
        capacity,
        scope: ScopeRecord { group: config.scope.group.into(), flatten: config.scope.flatten, groups },
        tokens,
    };
    Ok(Routing::assemble(decisions, with_stats.then_some(softmax.as_slice())))
}
