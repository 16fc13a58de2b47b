//! What the MoE layer forward costs on CPU, f32, against its references (the setup of
//! `benches/common/layer_case.rs`, shared with `cargo bench --bench layer`).
//!
//! After a warm-up, each repetition runs the four implementations once, in a rotating order so
//! that noise hits all alike; the reported time is the median over repetitions. The last line is
//! `moe_vs_dense=<dense/moe> moe_vs_mixtral=<mixtral/moe>`, each the minimum over both sizes
//! (`dense`: the FFN through candle's ops); each size's line also gives `dense-host/moe`, against
//! the same FFN on our host kernel.
//!
//! Run: `cargo run --release --example layer_cost [-- --reps N]`.

#[path = "../benches/common/layer_case.rs"]
mod layer_case;
#[path = "common/timing.rs"]
mod timing;

use candle_core::Device;
use layer_case::{LayerCase, BATCH, FFN, HIDDEN, SEQ, SIZES, TOP_K};
use std::time::{Duration, Instant};
use timing::{median, ms};

const WARMUP: usize = 3;

/// Median times of (moe, dense, dense-host, mixtral).
fn measure(case: &LayerCase, reps: usize) -> candle_core::Result<[Duration; 4]> {
    let mut samples: [Vec<Duration>; 4] = Default::default();
    for rep in 0..WARMUP + reps {
        for slot in 0..4 {
            let which = (rep + slot) % 4;
            let start = Instant::now();
            let y = match which {
                0 => case.moe()?,
                1 => case.dense()?,
                2 => case.dense_host()?,
                _ => case.mixtral()?,
            };
            let elapsed = start.elapsed();
            drop(y);
            if rep >= WARMUP {
                samples[which].push(elapsed);
            }
        }
    }
    Ok(samples.map(median))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let reps = timing::reps(15)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "MoE layer forward, CPU f32, {threads} threads: T={} (batch {BATCH} x seq {SEQ}), H={HIDDEN}, FFN={FFN}, k={TOP_K}, dense FFN={}; median of {reps} after {WARMUP} warm-up",
        BATCH * SEQ,
        TOP_K * FFN
    );
    let (mut vs_dense_min, mut vs_mixtral_min) = (f64::INFINITY, f64::INFINITY);
    for experts in SIZES {
        let case = LayerCase::new(experts, &Device::Cpu)?;
        let [moe, dense, dense_host, mixtral] = measure(&case, reps)?;
        let per_moe = |t: Duration| t.as_secs_f64() / moe.as_secs_f64();
        let (vs_dense, vs_host, vs_mixtral) = (per_moe(dense), per_moe(dense_host), per_moe(mixtral));
        vs_dense_min = vs_dense_min.min(vs_dense);
        vs_mixtral_min = vs_mixtral_min.min(vs_mixtral);
        println!(
            "E={experts:<2} k={TOP_K}: moe {:7.2} ms | dense {:7.2} ms | dense-host {:7.2} ms | mixtral {:7.2} ms | dense/moe {vs_dense:.3} | dense-host/moe {vs_host:.3} | mixtral/moe {vs_mixtral:.3}",
            ms(moe),
            ms(dense),
            ms(dense_host),
            ms(mixtral),
        );
    }
    println!("moe_vs_dense={vs_dense_min:.3} moe_vs_mixtral={vs_mixtral_min:.3}");
    Ok(())
}
