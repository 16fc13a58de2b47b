//! The layer's CPU f32 path: dispatch, experts and combine on host memory, each expert one
//! task on one thread.
//!
//! Candle's CPU matmul splits even a 64-row product over every core; with the experts already
//! running as parallel tasks, that nesting cost E = 64 experts about a sixth of their time, and
//! the gather, concatenation, scaling and `index_add` between tensors another tenth of the layer
//! (BENCHMARKS.md). This path calls the same matmul kernel (`gemm`, candle's own) without
//! threads and applies the same elementwise formulas in the same order as the candle ops of the
//! device-generic path, so both give the same bits (tests compare them).

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

/// Dispatch → experts → combine for `x` (`[tokens, hidden]`, row-major) and each expert's kept
/// `(token, weight)` rows; `None` unless `x` and every busy expert's weights are f32 on the CPU.
///
/// The combine adds the weighted outputs in ascending expert order, as the generic path's
/// `index_add` does, so each token's sum has the same fixed order.
pub(super) fn apply(experts: &[Expert], x: &[f32], hidden: usize, rows: &[Vec<(usize, f32)>]) -> Option<Vec<f32>> {
    let busy: Vec<(&Expert, &[(usize, f32)])> =
        experts.iter().zip(rows).filter(|(_, r)| !r.is_empty()).map(|(e, r)| (e, r.as_slice())).collect();
    let outputs = busy
        .par_iter()
        .map(|&(expert, rows)| {
            let input: Vec<f32> = rows.iter().flat_map(|&(t, _)| &x[t * hidden..(t + 1) * hidden]).copied().collect();
            let mut out = expert.forward_host(&input, rows.len())?;
            for (row, &(_, w)) in out.chunks_exact_mut(hidden).zip(rows) {
                row.iter_mut().for_each(|v| *v *= w);
            }
            Some(out)
        })
        .collect::<Option<Vec<_>>>()?;
    let mut y = vec![0f32; x.len()];
    for (out, &(_, rows)) in outputs.iter().zip(&busy) {
        for (row, &(t, _)) in out.chunks_exact(hidden).zip(rows) {
            y[t * hidden..(t + 1) * hidden].iter_mut().zip(row).for_each(|(acc, v)| *acc += v);
        }
    }
    Some(y)
}

/// `w2 · (silu(w1 x) * w3 x)` for `tokens` rows on the calling thread.
///
/// `x`: `[tokens, hidden]`, `w13`: `[2*ffn, hidden]`, `w2`: `[hidden, ffn]`, all row-major.
pub(super) fn swiglu(x: &[f32], tokens: usize, w13: &[f32], w2: &[f32], ffn: usize) -> Vec<f32> {
    let hidden = w2.len() / ffn;
    assert!(
        x.len() == tokens * hidden && w13.len() == 2 * ffn * hidden && w2.len() == hidden * ffn,
        "SwiGLU operand sizes"
    );
    // h = x · w13ᵀ, [tokens, 2*ffn]: gate in the first ffn columns, up in the rest.
    let mut h = vec![0f32; tokens * 2 * ffn];
    // SAFETY: every pointer covers the rows × columns its strides address (asserted above).
    unsafe { matmul_t(tokens, 2 * ffn, hidden, x.as_ptr(), hidden, w13.as_ptr(), h.as_mut_ptr(), 2 * ffn) };
    for row in h.chunks_exact_mut(2 * ffn) {
        let (gate, up) = row.split_at_mut(ffn);
        for (g, &u) in gate.iter_mut().zip(up.iter()) {
            *g = *g / (1.0 + (-*g).exp()) * u; // candle's silu for f32, then its mul
        }
    }
    let mut y = vec![0f32; tokens * hidden];
    // SAFETY: as above; the activation is the gate half of each h row (row stride 2*ffn).
    unsafe { matmul_t(tokens, hidden, ffn, h.as_ptr(), 2 * ffn, w2.as_ptr(), y.as_mut_ptr(), hidden) };
    y
}

/// `dst[m, n] = lhs[m, k] · rhs[n, k]ᵀ` on the calling thread; `rhs` row-major, `lhs` and `dst`
/// rows `lhs_stride` and `dst_stride` apart.
///
/// # Safety
/// The pointers must cover every element these shapes and strides address.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_t(
    m: usize,
    n: usize,
    k: usize,
    lhs: *const f32,
    lhs_stride: usize,
    rhs: *const f32,
    dst: *mut f32,
    dst_stride: usize,
) {
    // gemm's arguments: dst (col, row strides), read_dst, lhs strides, rhs strides, alpha
    // (ignored as read_dst is false), beta (scales the product), conjugations, threads.
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_stride as isize,
        false,
        lhs,
        1,
        lhs_stride as isize,
        rhs,
        k as isize,
        1,
        0.0,
        1.0,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}
