//! The layer's CPU f32 path: dispatch, experts and combine on host memory, each block of an
//! expert's rows one task on one thread.
//!
//! Candle's CPU matmul splits even a 64-row product over every core and packs the weights again
//! on every call; the gather, concatenation, scaling and `index_add` between tensors cost another
//! tenth of the layer (BENCHMARKS.md). This path gathers rows straight into the kernel's layout,
//! multiplies by weights packed once at load (`kernel.rs`), and applies the elementwise formulas
//! of the device-generic path in the same order; the two differ only in the matmuls' summation
//! order (tests bound the difference).

use super::kernel::{Kernel, PackedRows, MR};
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

/// Rows of one expert a task runs at most: a multiple of [`MR`], large enough that each task's
/// pass over the expert's weights serves many rows, small enough that its activations stay in
/// L2 and that E = 8's ≈ 512 rows per expert make several tasks for the pool.
const TASK_ROWS: usize = 32 * MR;

/// Rows per task for `rows` rows: as few tasks as [`TASK_ROWS`] allows, of near-equal size (a
/// multiple of [`MR`]), so that no short task is left over for one thread at the end.
pub(super) fn task_rows(rows: usize) -> usize {
    let tasks = rows.div_ceil(TASK_ROWS).max(1);
    rows.div_ceil(tasks).next_multiple_of(MR).clamp(MR, TASK_ROWS)
}

/// Tokens one combine task sums.
const COMBINE_TOKENS: usize = 256;

/// Dispatch → experts → combine for `x` (`[tokens, hidden]`, row-major) and each expert's kept
/// `(token, weight)` rows, on `kernel`; `None` unless every busy expert has packed weights (f32 on the CPU).
///
/// Each task gathers up to [`TASK_ROWS`] of one expert's rows straight into the kernel's
/// layout and runs the expert; the combine, over ranges of tokens in parallel, adds each
/// weighted output (`v · w`, rounded, then added) in ascending expert order, as the generic
/// path's scale and `index_add` do, so each token's sum has the same fixed order.
pub(super) fn apply(
    kernel: Kernel,
    experts: &[Expert],
    x: &[f32],
    hidden: usize,
    rows: &[Vec<(usize, f32)>],
) -> Option<Vec<f32>> {
    let tasks: Vec<(&Expert, &[(usize, f32)])> =
        experts.iter().zip(rows).flat_map(|(e, r)| r.chunks(task_rows(r.len())).map(move |r| (e, r))).collect();
    let outputs = tasks
        .par_iter()
        .map_init(Scratch::default, |scratch, &(expert, rows)| {
            scratch.run(kernel, expert, x, hidden, rows.iter().map(|&(t, _)| t))
        })
        .collect::<Option<Vec<_>>>()?;
    let mut y = vec![0f32; x.len()];
    if hidden == 0 {
        return Some(y);
    }
    // Each range's (output row, weight, token), in task order, so in ascending expert order.
    let mut ranges = vec![Vec::new(); (x.len() / hidden).div_ceil(COMBINE_TOKENS)];
    for (out, &(_, rows)) in outputs.iter().zip(&tasks) {
        for (row, &(t, w)) in out.chunks_exact(hidden).zip(rows) {
            ranges[t / COMBINE_TOKENS].push((row, w, t % COMBINE_TOKENS));
        }
    }
    y.par_chunks_mut(COMBINE_TOKENS * hidden).zip(ranges).for_each(|(ys, rows)| {
        for (row, w, t) in rows {
            let acc = &mut ys[t * hidden..][..hidden];
            acc.iter_mut().zip(row).for_each(|(acc, &v)| *acc += v * w);
        }
    });
    Some(y)
}

/// The buffers a thread's tasks reuse: the gathered rows and the hidden activations.
#[derive(Default)]
pub(super) struct Scratch {
    input: PackedRows,
    act: PackedRows,
}

impl Scratch {
    /// `expert` on the rows `x[t]` (`x`: `[_, hidden]`) for `t` in `tokens`, on the calling
    /// thread: `[tokens, hidden]`, row-major; `None` unless its weights are packed.
    pub(super) fn run(
        &mut self,
        kernel: Kernel,
        expert: &Expert,
        x: &[f32],
        hidden: usize,
        tokens: impl ExactSizeIterator<Item = usize>,
    ) -> Option<Vec<f32>> {
        self.input.gather(x, hidden, tokens);
        expert.forward_packed(kernel, &self.input, &mut self.act)
    }
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
