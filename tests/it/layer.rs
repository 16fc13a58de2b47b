//! The MoE layer: outputs against a per-token reference, dtypes, weights from safetensors.

use candle_core::{DType, Device, Module, Tensor};
use moe_audit::config::preset;
use moe_audit::layer::{seeded_weights, LayerDims, MoeLayer, Seeded};
use moe_audit::MemoryBudget;

const H: usize = 16;
const F: usize = 32;

fn layer(name: &str, dtype: DType) -> MoeLayer {
    let config = preset(name).unwrap().config().unwrap();
    MoeLayer::seeded(config, H, F, 7, dtype, &Device::Cpu).unwrap()
}

fn input(b: usize, s: usize) -> Tensor {
    Seeded::new(11).normal(&[b, s, H], &Device::Cpu).unwrap()
}

/// Each token: the sum over its kept routes of weight × expert(x), in choice order.
fn reference(layer: &MoeLayer, x: &Tensor, routing: &moe_audit::Routing) -> Vec<Vec<f32>> {
    let x = x.flatten_to(1).unwrap();
    routing
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let row = x.narrow(0, i, 1).unwrap();
            let mut acc = vec![0.0f32; H];
            for r in t.routes.iter().filter(|r| r.kept) {
                let out =
                    layer.experts()[r.expert].forward(&row).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                acc.iter_mut().zip(out).for_each(|(a, o)| *a += r.weight * o);
            }
            acc
        })
        .collect()
}

fn assert_close(got: &Tensor, want: &[Vec<f32>], tol: f32) {
    let got = got.to_dtype(DType::F32).unwrap().flatten_to(1).unwrap().to_vec2::<f32>().unwrap();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() <= tol * (1.0 + b.abs()), "token {i}: {a} vs {b}");
        }
    }
}

#[test]
fn output_is_the_weighted_sum_of_kept_routes() {
    for name in ["mixtral", "megatron-probs", "megatron-probs-pad", "deepspeed-top2", "expert-choice", "switch"] {
        let layer = layer(name, DType::F32);
        let x = input(2, 12);
        let (y, routing) = layer.forward(&x).unwrap();
        assert_eq!(y.dims(), &[2, 12, H]);
        assert_close(&y, &reference(&layer, &x, &routing), 1e-5);
    }
}

/// The layer's CPU f32 path (weights packed at load, the host kernel, one task per block of an
/// expert's rows) against candle's ops on the same weights: each expert's rows through `x · Wᵀ`
/// matmuls, silu · up, scaled, `index_add`ed in ascending expert order. Only the matmuls'
/// summation order differs, so the outputs agree to within float rounding (the tolerance
/// ARCHITECTURE.md documents: 1e-5 of the output's scale). Sizes large enough that candle splits
/// its matmuls over threads.
#[test]
fn cpu_path_equals_the_candle_ops_up_to_summation_order() {
    let (h, f) = (64, 128);
    for name in ["mixtral", "megatron-probs", "expert-choice"] {
        let config = preset(name).unwrap().config().unwrap();
        let tensors =
            seeded_weights(LayerDims { hidden: h, ffn: f, experts: config.experts }, 3, &Device::Cpu).unwrap();
        let layer = MoeLayer::from_tensors(config, tensors.clone(), DType::F32, &Device::Cpu).unwrap();
        let x = Seeded::new(5).normal(&[4, 96, h], &Device::Cpu).unwrap();
        let (y, routing) = layer.forward(&x).unwrap();
        let xs = x.flatten_to(1).unwrap();
        let mut want = xs.zeros_like().unwrap();
        for (e, rows) in routing.expert_rows().iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            let (index, weight): (Vec<u32>, Vec<f32>) = rows.iter().map(|&(t, w)| (t as u32, w)).unzip();
            let index = Tensor::new(index.as_slice(), &Device::Cpu).unwrap();
            let weight = Tensor::new(weight.as_slice(), &Device::Cpu).unwrap().unsqueeze(1).unwrap();
            let w = |n: &str| tensors[&format!("experts.{e}.{n}.weight")].t().unwrap();
            let input = xs.index_select(&index, 0).unwrap();
            let act = (candle_nn::ops::silu(&input.matmul(&w("w1")).unwrap()).unwrap()
                * input.matmul(&w("w3")).unwrap())
            .unwrap();
            let out = act.matmul(&w("w2")).unwrap();
            // The expert alone, on this thread and through its Module, as the layer runs it.
            let expert = &layer.experts()[e];
            let alone = expert.forward_on_this_thread(&input).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(alone, expert.forward(&input).unwrap().to_vec2::<f32>().unwrap(), "{name}: expert {e}");
            assert_close(
                &Tensor::new(alone, &Device::Cpu).unwrap().unsqueeze(0).unwrap(),
                &out.to_vec2::<f32>().unwrap(),
                1e-5,
            );
            want = want.index_add(&index, &out.broadcast_mul(&weight).unwrap(), 0).unwrap();
        }
        assert_close(&y, &want.to_vec2::<f32>().unwrap(), 1e-5);
    }
}

#[test]
fn dropped_routes_contribute_nothing() {
    let layer = layer("megatron-probs", DType::F32);
    let x = input(2, 12);
    let (y, routing) = layer.forward(&x).unwrap();
    assert!(routing.stats.drop_rate > 0.0, "the test needs capacity to bind");
    // Keeping every route changes the output exactly where something was dropped.
    let mut all = routing.clone();
    all.tokens.iter_mut().flat_map(|t| &mut t.routes).for_each(|r| r.kept = true);
    let y_all = layer.apply(&x, &all).unwrap().flatten_to(1).unwrap().to_vec2::<f32>().unwrap();
    let y = y.flatten_to(1).unwrap().to_vec2::<f32>().unwrap();
    for (i, t) in routing.tokens.iter().enumerate() {
        let any_dropped = t.routes.iter().any(|r| !r.kept);
        assert_eq!(y[i] != y_all[i], any_dropped, "token {i}");
    }
}

#[test]
fn forward_is_bit_for_bit_deterministic() {
    let layer = layer("deepspeed-topk-probs", DType::F32);
    let x = input(3, 10);
    let (a, ra) = layer.forward(&x).unwrap();
    let (b, rb) = layer.forward(&x).unwrap();
    assert_eq!(ra, rb);
    assert_eq!(a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
}

#[test]
fn half_precision_inputs_run_and_stay_close_to_f32() {
    let x = input(2, 8);
    let (y32, _) = layer("mixtral", DType::F32).forward(&x).unwrap();
    let y32 = y32.flatten_to(1).unwrap().to_vec2::<f32>().unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let layer = layer("mixtral", dtype);
        let (y, routing) = layer.forward(&x.to_dtype(dtype).unwrap()).unwrap();
        assert_eq!(y.dtype(), dtype);
        assert_eq!(routing.tokens.len(), 16);
        // Near-ties may route differently in half precision; most tokens must agree closely.
        let y = y.to_dtype(DType::F32).unwrap().flatten_to(1).unwrap().to_vec2::<f32>().unwrap();
        let close = y
            .iter()
            .zip(&y32)
            .filter(|(a, b)| a.iter().zip(b.iter()).all(|(p, q)| (p - q).abs() < 0.05 * (1.0 + q.abs())))
            .count();
        assert!(close >= 12, "{dtype:?}: only {close} of 16 tokens close to f32");
    }
}

#[test]
fn safetensors_weights_give_the_same_layer_as_the_seed() {
    let config = preset("megatron-probs").unwrap().config().unwrap();
    let tensors = seeded_weights(LayerDims { hidden: H, ffn: F, experts: 8 }, 7, &Device::Cpu).unwrap();
    let dir = std::env::temp_dir().join(format!("moe-audit-layer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("layer.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let from_file =
        MoeLayer::from_safetensors(config.clone(), &path, DType::F32, &Device::Cpu, MemoryBudget::new(1 << 30))
            .unwrap();
    let seeded = MoeLayer::seeded(config.clone(), H, F, 7, DType::F32, &Device::Cpu).unwrap();
    let x = input(2, 6);
    let (a, ra) = from_file.forward(&x).unwrap();
    let (b, rb) = seeded.forward(&x).unwrap();
    assert_eq!(ra, rb);
    assert_eq!(a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());

    // The limit given is the one checked: the file fits in half of it, its tensors plus their
    // f64 copies (three times the f32 data) do not.
    let bytes = std::fs::metadata(&path).unwrap().len();
    let err = MoeLayer::from_safetensors(config.clone(), &path, DType::F64, &Device::Cpu, MemoryBudget::new(2 * bytes))
        .unwrap_err()
        .to_string();
    assert!(err.contains("the weights in") && err.contains("over the limit"), "{err}");

    let mut missing = tensors.clone();
    missing.remove("experts.3.w2.weight");
    candle_core::safetensors::save(&missing, &path).unwrap();
    let err = MoeLayer::from_safetensors(config.clone(), &path, DType::F32, &Device::Cpu, MemoryBudget::new(1 << 30))
        .unwrap_err()
        .to_string();
    assert!(err.contains("experts.3.w2.weight"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn wrong_hidden_size_is_a_clear_error() {
    let layer = layer("mixtral", DType::F32);
    let x = Tensor::zeros((1, 4, H + 1), DType::F32, &Device::Cpu).unwrap();
    let err = layer.forward(&x).unwrap_err().to_string();
    assert!(err.contains("hidden size 17"), "{err}");
}
