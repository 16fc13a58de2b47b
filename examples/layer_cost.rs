//! What the MoE layer forward costs on CPU, f32, against its two references (the same shapes
//! and weights as `benches/layer.rs`):
//!
//! * `moe`: our [`MoeLayer`] with the Mixtral preset (softmax, top-2, renormalised, dropless);
//! * `dense`: the ceiling, one dense SwiGLU FFN of size k × 1024 = 2048 on every token (the
//!   same active FLOPs), built as our own [`Expert`] so it runs the same kernel code;
//! * `mixtral`: candle-transformers 0.11.1's Mixtral `SparseMoeBlock` on the same tensors
//!   (a verbatim copy: the type is private upstream).
//!
//! T = 2048 tokens (batch 1 × seq 2048), H 512, expert FFN 1024, k 2, E 8 and E 64. After a
//! warm-up, each repetition runs the three implementations once, in a rotating order so that
//! noise hits all alike; the reported time is the median over repetitions.
//!
//! Output: one line per size, then as the last line
//! `moe_vs_dense=<dense/moe> moe_vs_mixtral=<mixtral/moe>`, each the minimum over both sizes.
//!
//! Run: `cargo run --release --example layer_cost [-- --reps N] [-- --breakdown]`.
//! `--breakdown` also times the stages of our forward (gate, routing, dispatch, experts,
//! combine) by re-running them one by one through the public API.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use moe_audit::layer::{seeded_weights, Expert, LayerDims, MoeLayer, Seeded};
use moe_audit::router::{logits_to_host, Router};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const BATCH: usize = 1;
const SEQ: usize = 2048;
const HIDDEN: usize = 512;
const FFN: usize = 1024;
const TOP_K: usize = 2;
const SIZES: [usize; 2] = [8, 64];

const LAYER_SEED: u64 = 0;
const DENSE_SEED: u64 = 1;
const INPUT_SEED: u64 = 2;

type BoxResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// candle-transformers 0.11.1 `models::mixtral::{BlockSparseTop2MLP, SparseMoeBlock}`, copied
/// verbatim (MIT/Apache-2.0) because both types are private; only the `Config` argument is
/// replaced by explicit sizes (its fields are `pub(crate)` too).
mod mixtral_block {
    use candle_core::{DType, Module, Result, Tensor};
    use candle_nn::{Activation, VarBuilder};
    use candle_transformers::models::with_tracing::{linear_no_bias, Linear};

    #[derive(Debug, Clone)]
    struct BlockSparseTop2MLP {
        w1: Linear,
        w2: Linear,
        w3: Linear,
        act_fn: Activation,
    }

    impl BlockSparseTop2MLP {
        fn new(hidden_sz: usize, intermediate_sz: usize, vb: VarBuilder) -> Result<Self> {
            let w1 = linear_no_bias(hidden_sz, intermediate_sz, vb.pp("w1"))?;
            let w2 = linear_no_bias(intermediate_sz, hidden_sz, vb.pp("w2"))?;
            let w3 = linear_no_bias(hidden_sz, intermediate_sz, vb.pp("w3"))?;
            Ok(Self { w1, w2, w3, act_fn: Activation::Silu })
        }
    }

    impl Module for BlockSparseTop2MLP {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let lhs = xs.apply(&self.w1)?.apply(&self.act_fn)?;
            let rhs = xs.apply(&self.w3)?;
            (lhs * rhs)?.apply(&self.w2)
        }
    }

    #[derive(Debug, Clone)]
    pub struct SparseMoeBlock {
        gate: Linear,
        experts: Vec<BlockSparseTop2MLP>,
        num_experts_per_tok: usize,
    }

    impl SparseMoeBlock {
        pub fn new(hidden: usize, ffn: usize, num_local_experts: usize, num_experts_per_tok: usize, vb: VarBuilder) -> Result<Self> {
            let gate = linear_no_bias(hidden, num_local_experts, vb.pp("gate"))?;
            let mut experts = Vec::with_capacity(num_local_experts);
            let vb = vb.pp("experts");
            for idx in 0..num_local_experts {
                let expert = BlockSparseTop2MLP::new(hidden, ffn, vb.pp(idx))?;
                experts.push(expert)
            }
            Ok(SparseMoeBlock { gate, experts, num_experts_per_tok })
        }
    }

    impl Module for SparseMoeBlock {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let (b_size, seq_len, hidden_dim) = xs.dims3()?;
            let xs = xs.reshape(((), hidden_dim))?;
            let router_logits = xs.apply(&self.gate)?;
            let routing_weights = candle_nn::ops::softmax_last_dim(&router_logits)?;
            let routing_weights = routing_weights.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let mut top_x = vec![vec![]; self.experts.len()];
            let mut selected_rws = vec![vec![]; self.experts.len()];
            for (row_idx, rw) in routing_weights.iter().enumerate() {
                let mut dst = (0..rw.len() as u32).collect::<Vec<u32>>();
                dst.sort_by(|&i, &j| rw[j as usize].total_cmp(&rw[i as usize]));
                let mut sum_routing_weights = 0f32;
                for &expert_idx in dst.iter().take(self.num_experts_per_tok) {
                    let expert_idx = expert_idx as usize;
                    let routing_weight = rw[expert_idx];
                    sum_routing_weights += routing_weight;
                    top_x[expert_idx].push(row_idx as u32);
                }
                for &expert_idx in dst.iter().take(self.num_experts_per_tok) {
                    let expert_idx = expert_idx as usize;
                    let routing_weight = rw[expert_idx];
                    selected_rws[expert_idx].push(routing_weight / sum_routing_weights)
                }
            }
            let mut ys = xs.zeros_like()?;
            for (expert_idx, expert_layer) in self.experts.iter().enumerate() {
                let top_x = &top_x[expert_idx];
                if top_x.is_empty() {
                    continue;
                }
                let top_x = Tensor::new(top_x.as_slice(), xs.device())?;
                let selected_rws = Tensor::new(selected_rws[expert_idx].as_slice(), xs.device())?.reshape(((), 1))?;
                let current_state = xs.index_select(&top_x, 0)?.reshape(((), hidden_dim))?;
                let current_hidden_states = expert_layer.forward(&current_state)?;
                let current_hidden_states = current_hidden_states.broadcast_mul(&selected_rws)?;
                ys = ys.index_add(&top_x, &current_hidden_states, 0)?;
            }
            let ys = ys.reshape((b_size, seq_len, hidden_dim))?;
            Ok(ys)
        }
    }
}

use mixtral_block::SparseMoeBlock;

/// Prototype expert kernels for `--experiments` (scratch measurements, not library code): the
/// same SwiGLU math with other weight layouts, or with experts run on parallel threads.
mod experiments {
    use candle_core::{Result, Tensor, D};
    use std::collections::HashMap;

    #[derive(Clone, Copy, Debug, PartialEq)]
    pub enum Layout {
        /// The library's layout: `w13_t` `[H, 2F]` and `w2_t` `[F, H]`, both contiguous.
        FusedKn,
        /// `w13` `[2F, H]` contiguous, multiplied through a `.t()` view (candle_nn::Linear style).
        FusedNk,
        /// Separate `w1`, `w3` `[F, H]` and `w2` `[H, F]`, through `.t()` views (Mixtral's).
        SplitNk,
        /// Separate `w1_t`, `w3_t` `[H, F]` and `w2_t` `[F, H]`, contiguous.
        SplitKn,
    }

    pub struct Proto {
        pub layout: Layout,
        a: Tensor,
        b: Option<Tensor>,
        w2: Tensor,
        ffn: usize,
    }

    impl Proto {
        pub fn new(layout: Layout, w1: &Tensor, w3: &Tensor, w2: &Tensor) -> Result<Self> {
            let ffn = w1.dim(0)?;
            let (a, b, w2) = match layout {
                Layout::FusedKn => (Tensor::cat(&[w1, w3], 0)?.t()?.contiguous()?, None, w2.t()?.contiguous()?),
                Layout::FusedNk => (Tensor::cat(&[w1, w3], 0)?.contiguous()?, None, w2.contiguous()?),
                Layout::SplitNk => (w1.contiguous()?, Some(w3.contiguous()?), w2.contiguous()?),
                Layout::SplitKn => (w1.t()?.contiguous()?, Some(w3.t()?.contiguous()?), w2.t()?.contiguous()?),
            };
            Ok(Self { layout, a, b, w2, ffn })
        }

        pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
            match self.layout {
                Layout::FusedKn => {
                    let h = x.matmul(&self.a)?;
                    let gate = h.narrow(D::Minus1, 0, self.ffn)?;
                    let up = h.narrow(D::Minus1, self.ffn, self.ffn)?;
                    (candle_nn::ops::silu(&gate)? * up)?.matmul(&self.w2)
                }
                Layout::FusedNk => {
                    let h = x.matmul(&self.a.t()?)?;
                    let gate = h.narrow(D::Minus1, 0, self.ffn)?;
                    let up = h.narrow(D::Minus1, self.ffn, self.ffn)?;
                    (candle_nn::ops::silu(&gate)? * up)?.matmul(&self.w2.t()?)
                }
                Layout::SplitNk => {
                    let gate = x.matmul(&self.a.t()?)?;
                    let up = x.matmul(&self.b.as_ref().unwrap().t()?)?;
                    (candle_nn::ops::silu(&gate)? * up)?.matmul(&self.w2.t()?)
                }
                Layout::SplitKn => {
                    let gate = x.matmul(&self.a)?;
                    let up = x.matmul(self.b.as_ref().unwrap())?;
                    (candle_nn::ops::silu(&gate)? * up)?.matmul(&self.w2)
                }
            }
        }
    }

    pub fn protos(tensors: &HashMap<String, Tensor>, experts: usize, layout: Layout) -> Result<Vec<Proto>> {
        (0..experts)
            .map(|i| {
                let w = |n: &str| tensors[&format!("experts.{i}.{n}.weight")].clone();
                Proto::new(layout, &w("w1"), &w("w3"), &w("w2"))
            })
            .collect()
    }

    /// Runs `f(e, rows of e)` for every non-empty expert; with `threads > 1`, experts are split
    /// into contiguous chunks of about equal row counts, one OS thread each, and candle's gemm is
    /// told to stay single-threaded (`RAYON_NUM_THREADS=1`, read by candle on every matmul).
    pub fn run_experts(
        gathered: &Tensor,
        counts: &[usize],
        threads: usize,
        f: &(dyn Fn(usize, &Tensor) -> Result<Tensor> + Sync),
    ) -> Result<Vec<Tensor>> {
        let mut starts = Vec::with_capacity(counts.len());
        let mut acc = 0;
        for &c in counts {
            starts.push(acc);
            acc += c;
        }
        let one = |e: usize| -> Result<Option<Tensor>> {
            if counts[e] == 0 {
                return Ok(None);
            }
            Ok(Some(f(e, &gathered.narrow(0, starts[e], counts[e])?)?))
        };
        if threads <= 1 {
            return Ok((0..counts.len()).map(one).collect::<Result<Vec<_>>>()?.into_iter().flatten().collect());
        }
        // Chunk boundaries by cumulative rows.
        let mut bounds = vec![0];
        for t in 1..threads {
            let target = acc * t / threads;
            let e = starts.iter().position(|&s| s >= target).unwrap_or(counts.len());
            bounds.push(e.max(*bounds.last().unwrap()));
        }
        bounds.push(counts.len());
        std::env::set_var("RAYON_NUM_THREADS", "1");
        let parts: Vec<Result<Vec<Option<Tensor>>>> = std::thread::scope(|s| {
            let handles: Vec<_> = bounds
                .windows(2)
                .map(|w| {
                    let (lo, hi) = (w[0], w[1]);
                    s.spawn(move || (lo..hi).map(one).collect::<Result<Vec<_>>>())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        std::env::remove_var("RAYON_NUM_THREADS");
        let mut out = Vec::new();
        for p in parts {
            out.extend(p?.into_iter().flatten());
        }
        Ok(out)
    }
}


/// One size: the three implementations and the shared input.
struct Case {
    experts: usize,
    moe: MoeLayer,
    dense: Expert,
    mixtral: SparseMoeBlock,
    x: Tensor,
    /// The layer's and the dense baseline's tensors, for `--experiments`.
    tensors: HashMap<String, Tensor>,
    dense_tensors: HashMap<String, Tensor>,
}

fn setup(experts: usize, device: &Device) -> BoxResult<Case> {
    let mut config = moe_audit::config::preset("mixtral").ok_or("no mixtral preset")?.config()?;
    config.experts = experts;
    assert_eq!(config.k(), TOP_K);

    let tensors: HashMap<String, Tensor> = seeded_weights(LayerDims { hidden: HIDDEN, ffn: FFN, experts }, LAYER_SEED, device)?;
    let mixtral_vb = VarBuilder::from_tensors(tensors.clone(), DType::F32, device);
    let mixtral = SparseMoeBlock::new(HIDDEN, FFN, experts, TOP_K, mixtral_vb)?;
    let moe = MoeLayer::from_tensors(config, tensors.clone(), DType::F32, device)?;

    let dense_tensors = seeded_weights(LayerDims { hidden: HIDDEN, ffn: TOP_K * FFN, experts: 1 }, DENSE_SEED, device)?;
    let dense_vb = VarBuilder::from_tensors(dense_tensors.clone(), DType::F32, device);
    let dense = Expert::new(HIDDEN, TOP_K * FFN, dense_vb.pp("experts.0"))?;

    let x = Seeded::new(INPUT_SEED).normal(&[BATCH, SEQ, HIDDEN], device)?;

    // Same weights, same routing rule: the outputs must agree up to float summation order.
    let (ours, _) = moe.forward(&x)?;
    let theirs = mixtral.forward(&x)?;
    let scale = theirs.abs()?.max_all()?.to_scalar::<f32>()?;
    let diff = (&ours - &theirs)?.abs()?.max_all()?.to_scalar::<f32>()?;
    if diff > 1e-4 * scale.max(1e-3) {
        return Err(format!("E={experts}: MoeLayer and Mixtral SparseMoeBlock differ: max |diff| {diff:e}, max |y| {scale:e}").into());
    }
    eprintln!("E={experts}: MoeLayer vs Mixtral SparseMoeBlock max |diff| {diff:.3e} (max |y| {scale:.3e})");
    Ok(Case { experts, moe, dense, mixtral, x, tensors, dense_tensors })
}

/// The dense ceiling on `[batch, seq, hidden]` (our experts take `[tokens, hidden]`).
fn dense_forward(dense: &Expert, x: &Tensor) -> candle_core::Result<Tensor> {
    let (b, s, h) = x.dims3()?;
    dense.forward(&x.reshape((b * s, h))?)?.reshape((b, s, h))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn time<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed())
}

/// Medians of (moe, dense, mixtral) over `reps` rotating-order repetitions.
fn measure(case: &Case, warmup: usize, reps: usize) -> BoxResult<[Duration; 3]> {
    let mut samples: [Vec<Duration>; 3] = Default::default();
    for rep in 0..warmup + reps {
        for slot in 0..3 {
            let which = (rep + slot) % 3;
            let (out, d) = match which {
                0 => time(|| case.moe.forward(&case.x).map(|(y, _)| y).map_err(Box::<dyn std::error::Error>::from)),
                1 => time(|| dense_forward(&case.dense, &case.x).map_err(Box::<dyn std::error::Error>::from)),
                _ => time(|| case.mixtral.forward(&case.x).map_err(Box::<dyn std::error::Error>::from)),
            };
            drop(out?);
            if rep >= warmup {
                samples[which].push(d);
            }
        }
    }
    let [a, b, c] = samples;
    Ok([median(a), median(b), median(c)])
}

const STAGES: [&str; 6] = ["gate", "route", "rows", "gather", "experts", "combine"];

/// Our forward split into stages (the same calls as `MoeLayer::forward`/`apply`), medians.
fn breakdown(case: &Case, warmup: usize, reps: usize) -> BoxResult<[Duration; 6]> {
    let layer = &case.moe;
    let router = layer.router();
    let mut samples: [Vec<Duration>; 6] = Default::default();
    for rep in 0..warmup + reps {
        let mut t = [Duration::ZERO; 6];
        let (logits, d) = time(|| router.scores(&case.x));
        t[0] = d;
        let logits = logits?;
        let (routing, d) = time(|| logits_to_host(&logits).and_then(|l| router.assign(l.view())));
        t[1] = d;
        let routing = routing?;
        let (b, s, h) = case.x.dims3()?;
        let x = case.x.reshape((b * s, h))?;
        let (prepared, d) = time(|| -> BoxResult<_> {
            let rows = routing.expert_rows();
            let (index, weight): (Vec<u32>, Vec<f32>) = rows.iter().flatten().map(|&(t, w)| (t as u32, w)).unzip();
            let index = Tensor::new(index.as_slice(), x.device())?;
            let weight = Tensor::new(weight.as_slice(), x.device())?.to_dtype(x.dtype())?.unsqueeze(1)?;
            Ok((rows, index, weight))
        });
        t[2] = d;
        let (rows, index, weight) = prepared?;
        let (gathered, d) = time(|| x.index_select(&index, 0));
        t[3] = d;
        let gathered = gathered?;
        let (outputs, d) = time(|| -> candle_core::Result<Vec<Tensor>> {
            let mut outputs = Vec::new();
            let mut start = 0;
            for (expert, rows) in layer.experts().iter().zip(&rows) {
                if !rows.is_empty() {
                    outputs.push(expert.forward(&gathered.narrow(0, start, rows.len())?)?);
                    start += rows.len();
                }
            }
            Ok(outputs)
        });
        t[4] = d;
        let outputs = outputs?;
        let (y, d) = time(|| -> candle_core::Result<Tensor> {
            let weighted = Tensor::cat(&outputs, 0)?.broadcast_mul(&weight)?;
            x.zeros_like()?.index_add(&index, &weighted, 0)?.reshape((b, s, h))
        });
        t[5] = d;
        drop(y?);
        if rep >= warmup {
            for (v, d) in samples.iter_mut().zip(t) {
                v.push(d);
            }
        }
    }
    Ok(samples.map(median))
}


/// `--experiments`: the expert stage alone (routing and gather done once) under prototype
/// kernels, and the dense ceiling under the same layouts; medians over interleaved reps.
fn run_experiments(case: &Case, warmup: usize, reps: usize) -> BoxResult<()> {
    use experiments::{protos, run_experts, Layout, Proto};
    let layer = &case.moe;
    let routing = layer.router().route(&case.x)?;
    let (b, s, h) = case.x.dims3()?;
    let x = case.x.reshape((b * s, h))?;
    let rows = routing.expert_rows();
    let counts: Vec<usize> = rows.iter().map(Vec::len).collect();
    let index: Vec<u32> = rows.iter().flatten().map(|&(t, _)| t as u32).collect();
    let gathered = x.index_select(&Tensor::new(index.as_slice(), x.device())?, 0)?;
    let layouts = [Layout::FusedKn, Layout::FusedNk, Layout::SplitNk, Layout::SplitKn];
    let moe_protos: Vec<Vec<Proto>> = layouts.iter().map(|&l| protos(&case.tensors, case.experts, l)).collect::<candle_core::Result<_>>()?;
    let dense_protos: Vec<Proto> = layouts
        .iter()
        .map(|&l| protos(&case.dense_tensors, 1, l).map(|mut v| v.remove(0)))
        .collect::<candle_core::Result<_>>()?;
    let lib = |e: usize, xs: &Tensor| layer.experts()[e].forward(xs);
    let (gathered, counts, x) = (&gathered, counts.as_slice(), &x);

    type Run<'a> = Box<dyn Fn() -> candle_core::Result<Vec<Tensor>> + 'a>;
    let mut variants: Vec<(String, Run)> = Vec::new();
    variants.push(("moe experts, library Expert, 1 gemm pool".into(), Box::new(|| run_experts(gathered, counts, 1, &lib))));
    variants.push(("moe experts, library Expert, 2 expert threads".into(), Box::new(|| run_experts(gathered, counts, 2, &lib))));
    for (l, ps) in layouts.iter().zip(&moe_protos) {
        let f = move |e: usize, xs: &Tensor| ps[e].forward(xs);
        variants.push((format!("moe experts, {l:?}"), Box::new(move || run_experts(gathered, counts, 1, &f))));
        variants.push((format!("moe experts, {l:?}, 2 expert threads"), Box::new(move || run_experts(gathered, counts, 2, &f))));
    }
    variants.push(("dense, library Expert".into(), Box::new(|| Ok(vec![case.dense.forward(x)?]))));
    for (l, p) in layouts.iter().zip(&dense_protos) {
        variants.push((format!("dense, {l:?}"), Box::new(move || Ok(vec![p.forward(x)?]))));
    }

    // Every moe variant must reproduce the library's expert outputs.
    let reference = Tensor::cat(&variants[0].1()?, 0)?;
    for (name, run) in &variants {
        if name.starts_with("moe") {
            let d = (Tensor::cat(&run()?, 0)? - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(d < 1e-4, "{name}: differs from the library by {d}");
        }
    }
    let n = variants.len();
    let mut samples = vec![Vec::new(); n];
    for rep in 0..warmup + reps {
        for slot in 0..n {
            let v = (rep + slot) % n;
            let (out, d) = time(|| (variants[v].1)());
            drop(out?);
            if rep >= warmup {
                samples[v].push(d);
            }
        }
    }
    println!("  E={} expert-stage experiments (median ms, rows per expert {}..{}):", case.experts, counts.iter().min().unwrap(), counts.iter().max().unwrap());
    for ((name, _), v) in variants.iter().zip(samples) {
        println!("    {:<50} {:8.2}", name, ms(median(v)));
    }
    Ok(())
}

fn main() -> BoxResult<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let reps = args.iter().position(|a| a == "--reps").and_then(|i| args.get(i + 1)).map(|n| n.parse()).transpose()?.unwrap_or(15);
    let show_breakdown = args.iter().any(|a| a == "--breakdown");
    let show_experiments = args.iter().any(|a| a == "--experiments");
    let warmup = 3;
    let device = Device::Cpu;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "MoE layer forward, CPU f32, {threads} threads: T={} (batch {BATCH} x seq {SEQ}), H={HIDDEN}, FFN={FFN}, k={TOP_K}, dense FFN={}; median of {reps} after {warmup} warm-up",
        BATCH * SEQ,
        TOP_K * FFN
    );
    let (mut min_dense, mut min_mixtral) = (f64::INFINITY, f64::INFINITY);
    for experts in SIZES {
        let case = setup(experts, &device)?;
        let [moe, dense, mixtral] = measure(&case, warmup, reps)?;
        let vs_dense = dense.as_secs_f64() / moe.as_secs_f64();
        let vs_mixtral = mixtral.as_secs_f64() / moe.as_secs_f64();
        min_dense = min_dense.min(vs_dense);
        min_mixtral = min_mixtral.min(vs_mixtral);
        println!(
            "E={:<2} k={TOP_K}: moe {:8.2} ms | dense {:8.2} ms | mixtral {:8.2} ms | dense/moe {:.3} | mixtral/moe {:.3}",
            case.experts,
            ms(moe),
            ms(dense),
            ms(mixtral),
            vs_dense,
            vs_mixtral
        );
        if show_breakdown {
            let stages = breakdown(&case, warmup, reps)?;
            let total: Duration = stages.iter().sum();
            let parts: Vec<String> = STAGES.iter().zip(stages).map(|(n, d)| format!("{n} {:.2}", ms(d))).collect();
            println!("  E={:<2} moe stages (ms): {} | sum {:.2}", case.experts, parts.join(" | "), ms(total));
        }
        if show_experiments {
            run_experiments(&case, warmup, reps)?;
        }
    }
    println!("moe_vs_dense={min_dense:.3} moe_vs_mixtral={min_mixtral:.3}");
    Ok(())
}
