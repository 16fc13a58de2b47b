//! The probes: each builds cases (pairs of calls whose aligned tokens must route alike).
//! Random changes rarely make a capacity bind, so every probe that can also makes *targeted*
//! changes: later or neighbouring tokens pushed hard toward the experts a token uses.

use super::case::{Call, Case};
use super::Probe;
use crate::error::Result;
use crate::layer::Seeded;
use crate::router::{logits_to_host, Router};
use crate::routing::Routing;
use candle_core::Device;
use ndarray::{s, Array2, Array3, Axis};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::Arc;

/// Logit given to the targeted expert of a crafted token (the others get 0): strong enough to win
/// every gate comparison (softmax gate ≈ 0.999 over 8 experts).
const TARGET_LOGIT: f32 = 8.0;

/// What the probes share: the router, the base call and its routing, and seeded randomness.
pub(crate) struct Ctx<'a> {
    pub router: &'a dyn Router,
    pub base: Arc<Call>,
    pub base_routing: Routing,
    pub trials: usize,
    pub seed: u64,
    /// Whether cases may run in parallel (see `looks_pure`).
    pub pure: bool,
    /// The hidden states behind `base`, for a router with a score stage.
    pub hidden: Option<candle_core::Tensor>,
}

impl Ctx<'_> {
    fn rng(&self, probe: Probe) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(self.seed ^ (0x5eed_0000 + probe as u64))
    }

    /// Width of an input row: E logits, or H hidden values (see [`Router::row_width`]).
    fn width(&self) -> usize {
        self.router.row_width()
    }

    /// `n` fresh token rows from the same distribution as the base call: seeded hidden states
    /// through the router's score stage, or standard-normal logits for a logits-only router.
    pub fn fresh(&self, n: usize, rng: &mut ChaCha8Rng) -> Result<Array2<f32>> {
        self.fresh_from(n, rng.random())
    }

    /// [`Ctx::fresh`] from the seed it draws, so that trials can draw their seeds in order and
    /// their rows in parallel (at H = 512 the seeded normals are most of what F and N build).
    fn fresh_from(&self, n: usize, seed: u64) -> Result<Array2<f32>> {
        let mut seeded = Seeded::new(seed);
        let logits = match self.router.hidden_size() {
            Some(h) => logits_to_host(&self.router.scores(&hidden_states(self.router, (1, n), h, seed)?)?)?,
            None => {
                let t = seeded.normal(&[1, n, self.width()], &Device::Cpu)?;
                Array3::from_shape_vec((1, n, self.width()), t.flatten_all()?.to_vec1()?).expect("shape")
            }
        };
        Ok(logits.index_axis_move(Axis(0), 0))
    }

    /// `n` copies of a crafted token row that wants expert `e` above all others.
    fn targeted_rows(&self, n: usize, e: usize) -> Array2<f32> {
        let row = self.router.targeted_row(e).unwrap_or_else(|| {
            let mut row = vec![0.0; self.width()];
            row[e] = TARGET_LOGIT;
            row
        });
        Array2::from_shape_fn((n, self.width()), |(_, j)| row[j])
    }

    /// The expert a token is pushed toward in trial `trial`: its routes in turn (1st choice, 2nd
    /// choice, ...), or its strongest logit when it has no route (expert choice); for a router
    /// fed hidden rows (no logits to read), the experts in turn.
    fn target_of(&self, batch: usize, pos: usize, trial: usize) -> usize {
        let routes = &self.base_routing.token(batch, pos).routes;
        let real: Vec<usize> = routes.iter().filter(|r| !r.padded).map(|r| r.expert).collect();
        let experts = self.router.experts();
        if real.is_empty() && self.width() != experts {
            (pos + trial) % experts.max(1)
        } else if real.is_empty() {
            let row = self.base.logits.slice(s![batch, pos, ..]);
            crate::routing::scores::top_k(row.as_slice().expect("contiguous row"), 1)[0]
        } else {
            real[trial % real.len()]
        }
    }
}

/// Hidden states `[batch, seq_len, h]` from `seed`: the router's own draw, or standard normal.
pub(crate) fn hidden_states(
    router: &dyn Router,
    (b, s): (usize, usize),
    h: usize,
    seed: u64,
) -> Result<candle_core::Tensor> {
    match router.draw_hidden((b, s), seed)? {
        Some(x) => Ok(x),
        None => Seeded::new(seed).normal(&[b, s, h], &Device::Cpu),
    }
}

/// A probe's cases: P makes its case for position t on demand (one per position, so memory
/// stays O(T·E)); the other probes build theirs up front.
pub(crate) enum Cases<'a> {
    /// P over the base call of this context.
    Prefix(&'a Ctx<'a>),
    /// Cases built by F, N or R.
    Built(Vec<Case>),
}

impl Cases<'_> {
    pub fn len(&self) -> usize {
        match self {
            Cases::Prefix(ctx) => ctx.base.dims().1.saturating_sub(1),
            Cases::Built(cases) => cases.len(),
        }
    }

    pub fn get(&self, i: usize) -> Cow<'_, Case> {
        match self {
            Cases::Prefix(ctx) => Cow::Owned(prefix_case(ctx, i)),
            Cases::Built(cases) => Cow::Borrowed(&cases[i]),
        }
    }
}

/// P at position t: every sequence truncated after t; positions ≤ t compared.
fn prefix_case(ctx: &Ctx, t: usize) -> Case {
    let b = ctx.base.dims().0;
    Case {
        compare: vec![t + 1; b],
        change_from: vec![Some(t + 1); b],
        ..Case::aligned(&ctx.base, ctx.base.truncate(t + 1))
    }
}

/// F: same length, change only the tokens after t of one sequence; half the trials random,
/// half targeted at the experts token t uses.
pub(crate) fn future(ctx: &Ctx) -> Result<Vec<Case>> {
    let (b, s) = ctx.base.dims();
    if s < 2 {
        return Ok(Vec::new());
    }
    let mut rng = ctx.rng(Probe::F);
    let plans: Vec<_> = (0..ctx.trials)
        .map(|trial| {
            let seq = rng.random_range(0..b);
            let t = rng.random_range(0..s - 1);
            (seq, t, if trial % 2 == 0 { Rows::Fresh(rng.random()) } else { Rows::Toward(seq, t) })
        })
        .collect();
    build(ctx, plans, |trial, (seq, t, rows)| {
        let mut changed = Call::clone(&ctx.base);
        changed.logits.slice_mut(s![seq, t + 1.., ..]).assign(&rows.make(ctx, s - t - 1, trial)?);
        let mut compare = vec![0; b];
        compare[seq] = t + 1;
        let mut change_from = vec![None; b];
        change_from[seq] = Some(t + 1);
        Ok(Case { compare, change_from, ..Case::aligned(&ctx.base, changed) })
    })
}

/// A trial's new rows: fresh from a seed, or targeted at the experts of token (batch, pos).
#[derive(Clone, Copy)]
enum Rows {
    Fresh(u64),
    Toward(usize, usize),
}

impl Rows {
    fn make(self, ctx: &Ctx, n: usize, trial: usize) -> Result<Array2<f32>> {
        match self {
            Rows::Fresh(seed) => ctx.fresh_from(n, seed),
            Rows::Toward(batch, pos) => Ok(ctx.targeted_rows(n, ctx.target_of(batch, pos, trial / 2))),
        }
    }
}

/// The case of each trial's plan (its random choices drawn in trial order beforehand), built
/// in parallel for a router whose calls may run concurrently (the score stage makes rows).
fn build<P: Send>(ctx: &Ctx, plans: Vec<P>, case: impl Fn(usize, P) -> Result<Case> + Sync) -> Result<Vec<Case>> {
    if ctx.pure {
        plans.into_par_iter().enumerate().map(|(i, p)| case(i, p)).collect()
    } else {
        plans.into_iter().enumerate().map(|(i, p)| case(i, p)).collect()
    }
}

/// N: change one other sequence of the batch (random, or every token pushed toward the experts
/// of a token of another sequence); compare the untouched sequences.
pub(crate) fn neighbour(ctx: &Ctx) -> Result<Vec<Case>> {
    let (b, s) = ctx.base.dims();
    if b < 2 {
        return Ok(Vec::new());
    }
    let mut rng = ctx.rng(Probe::N);
    let plans: Vec<_> = (0..ctx.trials)
        .map(|trial| {
            let seq = rng.random_range(0..b);
            let rows = if trial % 2 == 0 {
                Rows::Fresh(rng.random())
            } else {
                let victim = (seq + 1 + rng.random_range(0..b - 1)) % b;
                Rows::Toward(victim, rng.random_range(0..s))
            };
            (seq, rows)
        })
        .collect();
    build(ctx, plans, |trial, (seq, rows)| {
        let mut changed = Call::clone(&ctx.base);
        changed.logits.slice_mut(s![seq, .., ..]).assign(&rows.make(ctx, s, trial)?);
        let mut compare = vec![s; b];
        compare[seq] = 0;
        Ok(Case { compare, ..Case::aligned(&ctx.base, changed) })
    })
}

/// R: permute the sequences, drop one, add one, append padding, and (for routers that take a
/// padding mask) pad on the left.
pub(crate) fn rebatch(ctx: &Ctx) -> Result<Vec<Case>> {
    let (b, s) = ctx.base.dims();
    let mut rng = ctx.rng(Probe::R);
    let mut cases = Vec::new();
    // Permutations: the reverse, then random shuffles.
    let mut orders: Vec<Vec<usize>> = if b > 1 { vec![(0..b).rev().collect()] } else { Vec::new() };
    for _ in 0..ctx.trials / 8 {
        let mut order: Vec<usize> = (0..b).collect();
        for i in (1..b).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        if order.iter().enumerate().any(|(i, &o)| i != o) {
            orders.push(order);
        }
    }
    for order in orders {
        let mut seq_map = vec![None; b];
        order.iter().enumerate().for_each(|(k, &i)| seq_map[i] = Some(k));
        cases.push(Case::whole(&ctx.base, ctx.base.select(&order), seq_map));
    }
    if b > 1 {
        let kept: Vec<usize> = (0..b - 1).collect();
        let mut seq_map: Vec<Option<usize>> = kept.iter().map(|&i| Some(i)).collect();
        seq_map.push(None);
        cases.push(Case::whole(&ctx.base, ctx.base.select(&kept), seq_map));
    }
    let mut grown = ctx.base.logits.clone();
    grown.append(Axis(0), ctx.fresh(s, &mut rng)?.insert_axis(Axis(0)).view()).expect("same shape");
    cases.push(Case::aligned(
        &ctx.base,
        Call { logits: grown, padding: ctx.base.padding.as_ref().map(|m| pad_rows(m, 1)) },
    ));

    // Padding: pad tokens have all-zero logits (no preference); masked when the router takes a mask.
    let m = (s / 4).max(1);
    let takes_mask = ctx.router.accepts_padding_mask();
    let mut appended = Call::new(
        ndarray::concatenate(Axis(1), &[ctx.base.logits.view(), Array3::zeros((b, m, ctx.width())).view()])
            .expect("same batch"),
    );
    if takes_mask {
        appended.padding = Some(Array2::from_shape_fn((b, s + m), |(_, p)| p >= s));
    }
    cases.push(Case { change_from: vec![Some(s); b], ..Case::aligned(&ctx.base, appended) });
    if takes_mask {
        let logits =
            ndarray::concatenate(Axis(1), &[Array3::zeros((b, m, ctx.width())).view(), ctx.base.logits.view()])
                .expect("same batch");
        let left = Call { logits, padding: Some(Array2::from_shape_fn((b, s + m), |(_, p)| p < m)) };
        cases.push(Case { offset: m, ..Case::aligned(&ctx.base, left) });
    }
    Ok(cases)
}

fn pad_rows(mask: &Array2<bool>, extra: usize) -> Array2<bool> {
    let (b, s) = mask.dim();
    Array2::from_shape_fn((b + extra, s), |(i, p)| i < b && mask[[i, p]])
}
