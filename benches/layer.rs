//! MoE layer forward on CPU, f32, against its references side by side (see
//! `common/layer_case.rs`): `layer/E{E}/moe` (ours), `layer/E{E}/dense` (a dense SwiGLU FFN
//! with the same active FLOPs on our kernel), `layer/E{E}/dense-candle` (the same FFN through
//! candle's ops), `layer/E{E}/mixtral` (the algorithm of candle-transformers' Mixtral
//! `SparseMoeBlock`), at T 2048, H 512, FFN 1024, k 2, E 8 and 64.
//!
//! Run: `cargo bench --bench layer`.

#[path = "common/layer_case.rs"]
mod layer_case;

use candle_core::Device;
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use layer_case::{LayerCase, BATCH, SEQ, SIZES};
use std::time::Duration;

fn bench_layer(c: &mut Criterion) {
    for experts in SIZES {
        let case = LayerCase::new(experts, &Device::Cpu).expect("layer case");
        let mut group = c.benchmark_group(format!("layer/E{experts}"));
        group
            .sampling_mode(SamplingMode::Flat)
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3))
            .throughput(Throughput::Elements((BATCH * SEQ) as u64));
        group.bench_function("moe", |b| b.iter(|| case.moe().unwrap()));
        group.bench_function("dense", |b| b.iter(|| case.dense().unwrap()));
        group.bench_function("dense-candle", |b| b.iter(|| case.dense_candle().unwrap()));
        group.bench_function("mixtral", |b| b.iter(|| case.mixtral().unwrap()));
        group.finish();
    }
}

criterion_group!(benches, bench_layer);
criterion_main!(benches);
