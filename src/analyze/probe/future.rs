//! F, future (C-content): the same length, only the tokens after t of one sequence changed;
//! half the trials random, half targeted at the experts token t uses.

use super::{build, run_cases, Cases, Ctx, Rows, Rule, Sample};
use crate::analyze::case::{Call, Case};
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::{Finding, Probe, Property};
use crate::error::Result;
use candle_core::Tensor;
use ndarray::s;
use rand::Rng;

/// Probe F.
pub(crate) struct Future;

impl Rule for Future {
    fn name(&self) -> &'static str {
        "future"
    }

    fn property(&self) -> Property {
        Property::CContent
    }

    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        run_cases(ctx, Probe::F, Cases::Built(cases(ctx)?), "needs a sequence of 2 or more tokens")
    }

    /// The first sequence's positions after the middle replaced by fresh rows.
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        let x = input.x;
        let (b, s, h) = x.dims3()?;
        let t = s / 2;
        let mut v = x.flatten_all()?.to_vec1::<f32>()?;
        let later = input.fresh(s - t - 1, 0xf)?.flatten_all()?.to_vec1::<f32>()?;
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

/// One case per trial: a random sequence and position t, the tokens after t replaced; every
/// trial's random choices drawn in order, its rows built in parallel.
fn cases(ctx: &Ctx) -> Result<Vec<Case>> {
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
