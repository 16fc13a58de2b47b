//! N, neighbour (B): one other sequence of the batch changed (random, or every token pushed
//! toward the experts of a token of another sequence); the untouched sequences compared.

use super::{build, run_cases, Cases, Ctx, Rows, Rule, Sample};
use crate::analyze::case::{Call, Case};
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::{Finding, Probe, Property};
use crate::error::Result;
use candle_core::Tensor;
use ndarray::s;
use rand::Rng;

/// Probe N.
pub(crate) struct Neighbour;

impl Rule for Neighbour {
    fn name(&self) -> &'static str {
        "neighbour"
    }

    fn property(&self) -> Property {
        Property::B
    }

    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        run_cases(ctx, Probe::N, Cases::Built(cases(ctx)?), "needs a batch of 2 or more")
    }

    /// The last sequence of the sample replaced by fresh rows (nothing with one sequence).
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        let x = input.x;
        let (b, s, _) = x.dims3()?;
        if b < 2 {
            return Ok(None);
        }
        let replaced = Tensor::cat(&[&x.narrow(0, 0, b - 1)?, &input.fresh(s, 0xa)?], 0)?;
        let mut compare = vec![s; b];
        compare[b - 1] = 0;
        Ok(Some(SampleCase { x: replaced, seq_map: input.all(), compare, exact: false }))
    }
}

/// One case per trial: a random sequence replaced; every trial's random choices drawn in
/// order, its rows built in parallel.
fn cases(ctx: &Ctx) -> Result<Vec<Case>> {
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
