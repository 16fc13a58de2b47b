//! F, future (C-content): the same length, only the tokens after t of one sequence changed;
//! half the trials random, half targeted at the experts token t uses.

use super::Modes;
use super::{run_cases, Cases, Ctx, Rows, Rule, Sample};
use crate::analyze::case::{Call, Case};
use crate::analyze::explain::positions_later;
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::witness::Witness;
use crate::analyze::{AuditOptions, Finding, Probe};
use candle_core::Tensor;
use moe_audit_core::error::Result;
use ndarray::s;
use rand::Rng;

/// Probe F.
pub(crate) struct Future;

impl Rule for Future {
    fn calls(&self, _: Option<&Witness>, _: &AuditOptions, _: Modes) -> [String; 2] {
        ["the sequence".into(), "the same sequence with later tokens changed".into()]
    }

    fn cause(&self, f: &Finding) -> String {
        positions_later(f).map_or("a later token changed".into(), |d| format!("a token {d} changed"))
    }

    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        let plans = plans(ctx);
        let make = |trial: usize| case(ctx, trial, plans[trial]);
        run_cases(ctx, Probe::F, Cases::of_trials(ctx, plans.len(), &make)?, "needs a sequence of 2 or more tokens")
    }

    /// The first sequence's positions after the middle replaced by fresh rows.
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        let x = input.x;
        let (b, s, h) = x.dims3()?;
        let t = s / 2;
        let mut v = x.flatten_all()?.to_vec1::<f32>()?;
        let later = input.fresh(s - t - 1, crate::seeds::FUTURE_SAMPLE)?.flatten_all()?.to_vec1::<f32>()?;
        v[(t + 1) * h..s * h].copy_from_slice(&later);
        let mut compare = vec![0; b];
        compare[0] = t + 1;
        Ok(Some(SampleCase {
            x: Tensor::from_vec(v, (b, s, h), x.device())?,
            seq_map: input.all(),
            compare,
            exact: false,
        }))
    }
}

/// One plan per trial: a random sequence and position t, and the rows for the tokens after t;
/// every trial's random choices drawn in order.
fn plans(ctx: &Ctx) -> Vec<(usize, usize, Rows)> {
    let (b, s) = ctx.base.dims();
    if s < 2 {
        return Vec::new();
    }
    let mut rng = ctx.rng(Probe::F);
    (0..ctx.trials)
        .map(|trial| {
            let seq = rng.random_range(0..b);
            let t = rng.random_range(0..s - 1);
            (seq, t, if trial % 2 == 0 { Rows::Fresh(rng.random()) } else { Rows::Toward(seq, t) })
        })
        .collect()
}

/// A trial's case: the tokens after t in its sequence replaced.
fn case(ctx: &Ctx, trial: usize, (seq, t, rows): (usize, usize, Rows)) -> Result<Case> {
    let (b, s) = ctx.base.dims();
    let mut changed = Call::clone(&ctx.base);
    changed.logits.slice_mut(s![seq, t + 1.., ..]).assign(&rows.make(ctx, s - t - 1, trial)?);
    let mut compare = vec![0; b];
    compare[seq] = t + 1;
    let mut change_from = vec![None; b];
    change_from[seq] = Some(t + 1);
    Ok(Case { compare, change_from, ..Case::aligned(&ctx.base, changed) })
}
