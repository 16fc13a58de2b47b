//! R, re-batch (B): the sequences permuted, one dropped, one added, padding appended and (for
//! routers that take a padding mask) padding on the left. A layer over N ranks takes batches of
//! a multiple of N only: N sequences are dropped or added.

use super::Modes;
use super::{run_cases, Cases, Ctx, Rule, Sample};
use crate::analyze::case::{Call, Case};
use crate::analyze::explain::plural;
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::witness::Witness;
use crate::analyze::{AuditOptions, Finding, Probe};
use crate::hints::HintsOf;
use moe_audit_core::error::Result;
use ndarray::{Array2, Array3, Axis};
use rand::Rng;

/// Probe R.
pub(crate) struct Rebatch;

impl Rule for Rebatch {
    fn calls(&self, w: Option<&Witness>, _: &AuditOptions, _: Modes) -> [String; 2] {
        [
            w.map_or("the batch".into(), |w| format!("a batch of {}", plural(w.a.batch, "sequence"))),
            w.map_or("the batch re-ordered, resized or re-padded".into(), |w| {
                format!("the batch {} ({} of {} tokens)", change(w), plural(w.b.batch, "sequence"), w.b.seq_len)
            }),
        ]
    }

    fn cause(&self, f: &Finding) -> String {
        f.witness
            .as_ref()
            .map_or("the batch re-ordered, resized or re-padded".into(), |w| format!("the batch {}", change(w)))
    }

    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        run_cases(ctx, Probe::R, Cases::Built(cases(ctx)?), "needs a sequence of 2 or more tokens")
    }

    /// The sample's sequences in reverse order.
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        let (b, s, _) = input.x.dims3()?;
        Ok(Some(SampleCase {
            x: input.x.flip(&[0])?,
            seq_map: (0..b).map(|i| Some(b - 1 - i)).collect(),
            compare: vec![s; b],
            exact: false,
        }))
    }
}

/// Which of R's changes a witness's second call made, read off the two calls' shapes (every
/// case changes one thing: the order, the number of sequences, or the padding).
fn change(w: &Witness) -> &'static str {
    use std::cmp::Ordering::*;
    match (w.b.batch.cmp(&w.a.batch), w.b.seq_len.cmp(&w.a.seq_len)) {
        (Less, _) if w.a.batch - w.b.batch > 1 => "with sequences dropped",
        (Less, _) => "with a sequence dropped",
        (Greater, _) if w.b.batch - w.a.batch > 1 => "with sequences added",
        (Greater, _) => "with a sequence added",
        (Equal, Greater) if w.token_b.pos > w.token_a.pos => "padded on the left",
        (Equal, Greater) => "padded on the right",
        _ => "re-ordered",
    }
}

fn cases(ctx: &Ctx) -> Result<Vec<Case>> {
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
    // Resized by one sequence, or by one per rank for a layer over ranks.
    let step = ctx.router.ranks().unwrap_or(1);
    if b > step {
        let kept: Vec<usize> = (0..b - step).collect();
        let seq_map = (0..b).map(|i| (i < b - step).then_some(i)).collect();
        cases.push(Case::whole(&ctx.base, ctx.base.select(&kept), seq_map));
    }
    let mut grown = ctx.base.logits.clone();
    let fresh = ctx.fresh(s * step, &mut rng)?.into_shape_with_order((step, s, ctx.width())).expect("shape");
    grown.append(Axis(0), fresh.view()).expect("same shape");
    cases.push(Case::aligned(
        &ctx.base,
        Call { logits: grown, padding: ctx.base.padding.as_ref().map(|m| pad_rows(m, step)), placement: None },
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
        let left = Call { logits, padding: Some(Array2::from_shape_fn((b, s + m), |(_, p)| p < m)), placement: None };
        cases.push(Case { offset: m, ..Case::aligned(&ctx.base, left) });
    }
    Ok(cases)
}

fn pad_rows(mask: &Array2<bool>, extra: usize) -> Array2<bool> {
    let (b, s) = mask.dim();
    Array2::from_shape_fn((b + extra, s), |(i, p)| i < b && mask[[i, p]])
}
