//! N, neighbour (B): one other sequence of the batch changed (random, or every token pushed
//! toward the experts of a token of another sequence); the untouched sequences compared.

use super::Modes;
use super::{run_cases, Cases, Ctx, Rows, Rule, Sample};
use crate::analyze::case::{Call, Case};
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::witness::Witness;
use crate::analyze::{AuditOptions, Finding, Probe};
use candle_core::Tensor;
use moe_audit_core::error::Result;
use ndarray::s;
use rand::Rng;

/// Probe N.
pub(crate) struct Neighbour;

impl Rule for Neighbour {
    fn calls(&self, _: Option<&Witness>, _: &AuditOptions, _: Modes) -> [String; 2] {
        ["the batch".into(), "the same batch with another sequence changed".into()]
    }

    fn cause(&self, _: &Finding) -> String {
        "another sequence of the batch".into()
    }

    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        let plans = plans(ctx);
        let make = |trial: usize| case(ctx, trial, plans[trial]);
        run_cases(ctx, Probe::N, Cases::of_trials(ctx, plans.len(), &make)?, "needs a batch of 2 or more")
    }

    /// The last sequence of the sample replaced by fresh rows (nothing with one sequence).
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        let x = input.x;
        let (b, s, _) = x.dims3()?;
        if b < 2 {
            return Ok(None);
        }
        let replaced = Tensor::cat(&[&x.narrow(0, 0, b - 1)?, &input.fresh(s, crate::seeds::NEIGHBOUR_SAMPLE)?], 0)?;
        let mut compare = vec![s; b];
        compare[b - 1] = 0;
        Ok(Some(SampleCase { x: replaced, seq_map: input.all(), compare, exact: false }))
    }
}

/// One plan per trial: a random sequence and the rows that replace it; every trial's random
/// choices drawn in order.
fn plans(ctx: &Ctx) -> Vec<(usize, Rows)> {
    let (b, s) = ctx.base.dims();
    if b < 2 {
        return Vec::new();
    }
    let mut rng = ctx.rng(Probe::N);
    (0..ctx.trials)
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
        .collect()
}

/// A trial's case: its sequence replaced, the others compared.
fn case(ctx: &Ctx, trial: usize, (seq, rows): (usize, Rows)) -> Result<Case> {
    let (b, s) = ctx.base.dims();
    let mut changed = Call::clone(&ctx.base);
    changed.logits.slice_mut(s![seq, .., ..]).assign(&rows.make(ctx, s, trial)?);
    let mut compare = vec![s; b];
    compare[seq] = 0;
    Ok(Case { compare, ..Case::aligned(&ctx.base, changed) })
}
