//! The layer's CPU f32 path: dispatch, experts and combine on host memory, each block of an
//! expert's rows one task on one thread.
//!
//! Candle's CPU matmul splits even a 64-row product over every core and packs the weights again
//! on every call; the gather, concatenation, scaling and `index_add` between tensors cost another
//! tenth of the layer (BENCHMARKS.md). This path gathers rows straight into the kernel's layout,
//! multiplies by weights packed once at load (`kernel.rs`), and applies the elementwise formulas
//! of the device-generic path in the same order; the two differ only in the matmuls' summation
//! order (tests bound the difference).

use super::kernel::{self, Kernel, PackedMatrix, PackedRows, MR};
use super::Expert;
use candle_core::{Storage, Tensor};
use rayon::prelude::*;

/// Runs `f` on the values of a contiguous f32 CPU tensor; `None` for any other tensor.
pub(super) fn with_cpu_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    match &*storage {
        Storage::Cpu(cpu) => cpu.as_slice::<f32>().ok().map(|values| f(&values[start..end])),
        _ => None,
    }
}

/// Rows of one expert a task runs at most: a multiple of [`MR`], small enough that E = 8's
/// ≈ 512 rows per expert make several tasks for the pool, large enough that each task's pass
/// over the expert's weights serves many rows.
pub(super) const TASK_ROWS: usize = 16 * MR;

/// Dispatch → experts → combine for `x` (`[tokens, hidden]`, row-major) and each expert's kept
/// `(token, weight)` rows, on `kernel`; `None` unless every busy expert has packed weights (f32 on the CPU).
///
/// Each task gathers up to [`TASK_ROWS`] of one expert's rows straight into the kernel's
/// layout, runs the expert and scales; the combine adds the weighted outputs in ascending
/// expert order, as the generic path's `index_add` does, so each token's sum has the same
/// fixed order.
pub(super) fn apply(
    kernel: Kernel,
    experts: &[Expert],
    x: &[f32],
    hidden: usize,
    rows: &[Vec<(usize, f32)>],
) -> Option<Vec<f32>> {
    let tasks: Vec<(&Expert, &[(usize, f32)])> =
        experts.iter().zip(rows).flat_map(|(e, r)| r.chunks(TASK_ROWS).map(move |r| (e, r))).collect();
    let outputs = tasks
        .par_iter()
        .map(|&(expert, rows)| {
            let input = PackedRows::gather(x, hidden, rows.iter().map(|&(t, _)| t));
            let mut out = expert.forward_packed(kernel, &input)?;
            for (row, &(_, w)) in out.chunks_exact_mut(hidden).zip(rows) {
                row.iter_mut().for_each(|v| *v *= w);
            }
            Some(out)
        })
        .collect::<Option<Vec<_>>>()?;
    let mut y = vec![0f32; x.len()];
    for (out, &(_, rows)) in outputs.iter().zip(&tasks) {
        for (row, &(t, _)) in out.chunks_exact(hidden).zip(rows) {
            y[t * hidden..(t + 1) * hidden].iter_mut().zip(row).for_each(|(acc, v)| *acc += v);
        }
    }
    Some(y)
}

/// `w2 · (silu(w1 x) * w3 x)` for the rows of `x` on the calling thread.
///
/// `w13`: `[2*ffn, hidden]` (gate rows, then up rows), `w2`: `[hidden, ffn]`, both packed.
/// Returns `[rows, hidden]`, row-major.
pub(super) fn swiglu(kernel: Kernel, x: &PackedRows, w13: &PackedMatrix, w2: &PackedMatrix) -> Vec<f32> {
    let (tokens, ffn, hidden) = (x.rows(), w2.inputs(), w2.outputs());
    assert!(w13.outputs() == 2 * ffn && w13.inputs() == hidden, "SwiGLU operand sizes");
    // h = x · w13ᵀ, [tokens, 2*ffn]: gate in the first ffn columns, up in the rest.
    let mut h = vec![0f32; tokens * 2 * ffn];
    kernel::matmul(kernel, x, w13, &mut h);
    let act = PackedRows::from_rows(tokens, ffn, |i, out| {
        let (gate, up) = h[i * 2 * ffn..(i + 1) * 2 * ffn].split_at(ffn);
        kernel::silu_mul(kernel, gate, up, out);
    });
    let mut y = vec![0f32; tokens * hidden];
    kernel::matmul(kernel, &act, w2, &mut y);
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::{MoeLayer, Seeded};
    use crate::router::Router;
    use candle_core::{DType, Device};

    /// Forcing a kernel (as `MOE_AUDIT_KERNEL` does) changes no bit of the layer's output: the
    /// fallback a binary takes on an AVX2-only machine gives what AVX-512 gives.
    #[test]
    fn every_kernel_gives_the_same_layer_output() {
        let (h, f) = (40, 72); // neither a multiple of a tile
        let config = crate::config::preset("mixtral").unwrap().config().unwrap();
        let layer = MoeLayer::seeded(config, h, f, 9, DType::F32, &Device::Cpu).unwrap();
        let x = Seeded::new(4).normal(&[2, 150, h], &Device::Cpu).unwrap();
        let routing = layer.router().route(&x).unwrap();
        let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let rows = routing.expert_rows();
        let run = |k: Kernel| apply(k, layer.experts(), &x, h, &rows).unwrap();
        let want: Vec<u32> = run(Kernel::Portable).iter().map(|v| v.to_bits()).collect();
        for kernel in Kernel::ALL.into_iter().filter(|k| k.available()) {
            assert_eq!(run(kernel).iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{}", kernel.name());
        }
    }
}
