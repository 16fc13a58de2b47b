//! The experts' matmul: weights packed once, at load, into the panels the kernel reads, and
//! register-tiled kernels for AVX-512, AVX2 + FMA and portable Rust, chosen at run time.
//!
//! Every output element is one fused multiply-add chain over `k` in ascending order, whatever
//! the kernel or tiling, so the three kernels give the same bits (tests compare them) and a run
//! gives the same bytes on an AVX-512 machine as on an AVX2-only one. `MOE_AUDIT_KERNEL=avx2`
//! (or `avx512`, `portable`; `auto` is the default) forces a kernel, e.g. to time the fallback.

use std::sync::OnceLock;

/// Columns of a weight panel: two AVX-512 vectors, four AVX2 ones.
pub(super) const NR: usize = 32;
/// Rows of a tile (the AVX-512 tile's height; two AVX2 tiles of 6).
pub(super) const MR: usize = 12;
/// Bytes a panel starts on: a cache line, so no vector load straddles two.
const ALIGN: usize = 64;

/// A kernel: which instructions the matmul runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512F tiles of 12 × 32.
    Avx512,
    /// AVX2 + FMA tiles of 6 × 16.
    Avx2,
    /// Plain Rust (`f32::mul_add`): any CPU, slowly where it has no FMA instruction.
    Portable,
}

/// The environment variable that forces a kernel.
pub(crate) const KERNEL_VAR: &str = "MOE_AUDIT_KERNEL";

impl Kernel {
    /// Every kernel, fastest first.
    pub const ALL: [Kernel; 3] = [Kernel::Avx512, Kernel::Avx2, Kernel::Portable];

    /// Its name, as `MOE_AUDIT_KERNEL` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Avx512 => "avx512",
            Kernel::Avx2 => "avx2",
            Kernel::Portable => "portable",
        }
    }

    /// Whether this CPU runs it.
    pub fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Avx512 | Kernel::Avx2 => false,
            Kernel::Portable => true,
        }
    }

    /// The fastest kernel this CPU runs.
    pub fn best() -> Kernel {
        Kernel::ALL.into_iter().find(|k| k.available()).unwrap_or(Kernel::Portable)
    }

    /// The kernel `MOE_AUDIT_KERNEL = value` asks for (unset, empty or `auto`: the best), or why
    /// it cannot run here.
    pub(crate) fn from_setting(value: Option<&str>) -> Result<Kernel, KernelError> {
        let text = value.map(str::trim).unwrap_or("");
        if text.is_empty() || text == "auto" {
            return Ok(Kernel::best());
        }
        let kernel =
            Kernel::ALL.into_iter().find(|k| k.name() == text).ok_or_else(|| KernelError::Unknown(text.to_string()))?;
        if !kernel.available() {
            return Err(KernelError::Unavailable(kernel));
        }
        Ok(kernel)
    }

    /// The kernel in force: `MOE_AUDIT_KERNEL`, read once (the binary checks it first and refuses
    /// a bad value; a library user's bad value falls back to the best).
    pub fn selected() -> Kernel {
        static SELECTED: OnceLock<Kernel> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let value = std::env::var(KERNEL_VAR).ok();
            Kernel::from_setting(value.as_deref()).unwrap_or_else(|_| Kernel::best())
        })
    }
}

/// Why `MOE_AUDIT_KERNEL` cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// No kernel of that name.
    #[error("{KERNEL_VAR} must be auto, avx512, avx2 or portable, got {0:?}")]
    Unknown(String),
    /// A kernel this CPU cannot run.
    #[error("{KERNEL_VAR}={}: this CPU has no {} instructions", .0.name(), .0.name())]
    Unavailable(Kernel),
    /// The variable is not text.
    #[error("{KERNEL_VAR} is not text: {0:?}")]
    NotText(std::ffi::OsString),
}

/// Checks `MOE_AUDIT_KERNEL` (for the binary's start).
pub fn check_setting() -> Result<Kernel, KernelError> {
    match std::env::var(KERNEL_VAR) {
        Ok(value) => Kernel::from_setting(Some(&value)),
        Err(std::env::VarError::NotPresent) => Ok(Kernel::best()),
        Err(std::env::VarError::NotUnicode(v)) => Err(KernelError::NotText(v)),
    }
}

/// `f32` values starting on a cache line.
#[derive(Debug)]
struct Aligned {
    buf: Vec<f32>,
    start: usize,
    len: usize,
}

impl Clone for Aligned {
    /// A new allocation, aligned again (a cloned `Vec` may start elsewhere in its line).
    fn clone(&self) -> Self {
        let mut copy = Self::zeros(self.len);
        copy.as_mut_slice().copy_from_slice(self.as_slice());
        copy
    }
}

impl Aligned {
    fn zeros(len: usize) -> Self {
        let pad = ALIGN / std::mem::size_of::<f32>();
        let buf = vec![0f32; len + pad];
        let start = buf.as_ptr().align_offset(ALIGN).min(pad);
        Self { buf, start, len }
    }
    /// `len` values, in the same allocation while it is large enough (old values stay).
    fn resize(&mut self, len: usize) {
        if self.start + len <= self.buf.len() {
            self.len = len;
        } else {
            *self = Self::zeros(len);
        }
    }
    fn as_slice(&self) -> &[f32] {
        &self.buf[self.start..self.start + self.len]
    }
    fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// A weight matrix `W` (`[n, k]`, row-major: `n` outputs of `k` inputs) stored as the kernel
/// reads it: panels of 32 outputs, each `[k][32]` (the last padded with zeros).
#[derive(Debug, Clone)]
pub(crate) struct PackedMatrix {
    n: usize,
    k: usize,
    panels: Aligned,
}

impl PackedMatrix {
    /// Packs `w` (`[n, k]`, row-major).
    pub(crate) fn pack(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "packing a [{n}, {k}] matrix");
        let mut panels = Aligned::zeros(Self::panel_count(n) * k * NR);
        for (p, panel) in panels.as_mut_slice().chunks_exact_mut(k * NR).enumerate() {
            for (j, row) in w.chunks_exact(k).skip(p * NR).take(NR).enumerate() {
                for (d, &v) in row.iter().enumerate() {
                    panel[d * NR + j] = v;
                }
            }
        }
        Self { n, k, panels }
    }

    fn panel_count(n: usize) -> usize {
        n.div_ceil(NR)
    }

    /// Bytes a packed `[n, k]` matrix takes (for memory estimates; none for an empty one).
    pub(crate) fn bytes_for(n: usize, k: usize) -> u64 {
        let values = (Self::panel_count(n) as u64).saturating_mul(NR as u64 * 4).saturating_mul(k as u64);
        if values == 0 {
            0
        } else {
            values.saturating_add(ALIGN as u64)
        }
    }
}

/// Activations as the kernel reads them: row-major, rows `stride` values apart, `stride` an odd
/// number of cache lines so that the [`MR`] rows a tile reads side by side fall in different
/// L1 sets (a stride of a power of two lines would put them all in one). One buffer serves
/// task after task ([`PackedRows::reset`]).
#[derive(Debug)]
pub(super) struct PackedRows {
    rows: usize,
    k: usize,
    stride: usize,
    values: Aligned,
}

impl PackedRows {
    /// `rows` rows of `k` values, the allocation kept while it is large enough; the values are
    /// what they were, for the caller to write every row.
    fn reset(&mut self, rows: usize, k: usize) {
        let line = ALIGN / std::mem::size_of::<f32>();
        let stride = (k.div_ceil(line) | 1) * line;
        (self.rows, self.k, self.stride) = (rows, k, stride);
        self.values.resize(rows * stride);
    }

    /// Where row `i` starts.
    fn row_ptr(&self, i: usize) -> *const f32 {
        self.values.as_slice()[i * self.stride..].as_ptr()
    }

    fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.values.as_mut_slice()[i * self.stride..][..self.k]
    }

    /// The rows `x[t]` for `t` in `tokens`, of `x` (`[_, k]`, row-major).
    pub(super) fn gather(&mut self, x: &[f32], k: usize, tokens: impl ExactSizeIterator<Item = usize>) {
        self.reset(tokens.len(), k);
        for (i, t) in tokens.enumerate() {
            self.row_mut(i).copy_from_slice(&x[t * k..(t + 1) * k]);
        }
    }
}

impl Default for PackedRows {
    fn default() -> Self {
        Self { rows: 0, k: 0, stride: 0, values: Aligned::zeros(0) }
    }
}

/// `a · wᵀ` (`[i, j] = Σ_d a[i, d] · w[j, d]`), row-major with `a.rows` rows of
/// `w.outputs()` values, on the calling thread with `kernel` (which must be available).
pub(super) fn matmul(kernel: Kernel, a: &PackedRows, w: &PackedMatrix) -> Vec<f32> {
    let (m, n, k) = (a.rows, w.n, w.k);
    assert!(a.k == k, "matmul operand sizes");
    assert!(kernel.available(), "the {} kernel does not run on this CPU", kernel.name());
    // Not zeroed first: the tiles write every element (a memset of each task's output was 2%
    // of the layer).
    let mut dst = Vec::<f32>::with_capacity(m * n);
    let out = dst.spare_capacity_mut().as_mut_ptr().cast::<f32>();
    for (p, panel) in w.panels.as_slice().chunks_exact(k * NR).enumerate() {
        let cols = NR.min(n - p * NR);
        for b in (0..m).step_by(MR) {
            let c = (out.wrapping_add(b * n + p * NR), n);
            let rows = MR.min(m - b);
            // SAFETY: `a` holds rows b.. of k values `a.stride` apart and `panel` k × NR; the
            // tile's rows b.. of stride n, `cols` from column p · NR, lie within the m × n
            // values allocated.
            unsafe { tile(kernel, Tile { rows, cols, k, a: (a.row_ptr(b), a.stride), b: panel.as_ptr(), c }) }
        }
    }
    // SAFETY: the row blocks cover rows 0..m and the panels columns 0..n: every value is written.
    unsafe { dst.set_len(m * n) };
    dst
}

/// `out = silu(a · w1ᵀ) · (a · w3ᵀ)`, SwiGLU's hidden activations, packed as the rows of the
/// next matmul: tile by tile, the gate's and the up projection's tiles go through [`silu_mul`] and
/// straight into place, so no `[rows, 2 · ffn]` intermediate is written (the bits are those of
/// the two matmuls and `silu_mul` run apart).
pub(super) fn swiglu_hidden(
    kernel: Kernel,
    a: &PackedRows,
    w1: &PackedMatrix,
    w3: &PackedMatrix,
    out: &mut PackedRows,
) {
    let (m, n, k) = (a.rows, w1.n, w1.k);
    assert!(a.k == k && w3.n == n && w3.k == k, "SwiGLU operand sizes");
    assert!(kernel.available(), "the {} kernel does not run on this CPU", kernel.name());
    out.reset(m, n);
    let (mut gate, mut up) = ([0f32; MR * NR], [0f32; MR * NR]);
    let panels = w1.panels.as_slice().chunks_exact(k * NR).zip(w3.panels.as_slice().chunks_exact(k * NR));
    for (p, (panel1, panel3)) in panels.enumerate() {
        let cols = NR.min(n - p * NR);
        for b in (0..m).step_by(MR) {
            let rows = MR.min(m - b);
            let input = (a.row_ptr(b), a.stride);
            // SAFETY: `a` holds rows b.. of k values `a.stride` apart, each panel k × NR; the
            // tiles write `rows` rows of `cols` into buffers of MR rows of NR.
            unsafe {
                tile(kernel, Tile { rows, cols, k, a: input, b: panel1.as_ptr(), c: (gate.as_mut_ptr(), NR) });
                tile(kernel, Tile { rows, cols, k, a: input, b: panel3.as_ptr(), c: (up.as_mut_ptr(), NR) });
            }
            for r in 0..rows {
                let (gate, up) = (&gate[r * NR..][..cols], &up[r * NR..][..cols]);
                silu_mul(kernel, gate, up, &mut out.row_mut(b + r)[p * NR..][..cols]);
            }
        }
    }
}

/// One tile of a product: `rows × cols` outputs (`rows ≤ MR`, `cols ≤ NR`) over `k` inputs.
#[derive(Clone, Copy)]
struct Tile {
    rows: usize,
    cols: usize,
    k: usize,
    /// The first input row and the distance between rows, in values.
    a: (*const f32, usize),
    /// The panel: `k × NR` values.
    b: *const f32,
    /// The first output and the distance between output rows, in values.
    c: (*mut f32, usize),
}

/// Computes `t` on `kernel`.
///
/// # Safety
/// `t.a` covers `rows` rows of `k` values, `t.b` `k × NR` values, and `t.c` every element of
/// `rows` rows, `cols` each; `kernel` runs on this CPU.
unsafe fn tile(kernel: Kernel, t: Tile) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => x86::tile_avx512(t),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => x86::tile_avx2(t),
        _ => tile_portable(t),
    }
}

/// The portable tile: the same chains as the vector kernels, one `mul_add` at a time.
///
/// # Safety
/// As [`tile`].
unsafe fn tile_portable(Tile { rows, cols, k, a: (a, lda), b, c: (c, ldc) }: Tile) {
    let mut acc = [[0f32; NR]; MR];
    for d in 0..k {
        let bd = std::slice::from_raw_parts(b.add(d * NR), NR);
        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
            let ar = *a.add(r * lda + d);
            for (s, &bv) in acc.iter_mut().zip(bd) {
                *s = ar.mul_add(bv, *s);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate().take(rows) {
        std::ptr::copy_nonoverlapping(acc.as_ptr(), c.add(r * ldc), cols);
    }
}

/// `out = silu(gate) · up = gate / (1 + exp(-gate)) · up`, lane by lane, with `exp` the
/// polynomial of [`exp_portable`]: each kernel runs the same IEEE operations in the same order,
/// so all give the same bits.
pub(super) fn silu_mul(kernel: Kernel, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len(), "silu operand sizes");
    assert!(kernel.available(), "the {} kernel does not run on this CPU", kernel.name());
    let done = match kernel {
        // SAFETY: the kernel runs on this CPU (asserted); the slices have equal lengths.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { x86::silu_mul_avx512(gate, up, out) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { x86::silu_mul_avx2(gate, up, out) },
        _ => 0,
    };
    for ((o, &g), &u) in out[done..].iter_mut().zip(&gate[done..]).zip(&up[done..]) {
        *o = g / (1.0 + exp_portable(-g)) * u;
    }
}

/// `exp` clamped to `[-87, 88]` (so `2^n` stays a normal float): Cephes' `expf` reduction by
/// `n = round(x / ln 2)` in two FMAs, a degree-5 polynomial, scaled by `2^n`; within 2 ulp of
/// `exp` there.
fn exp_portable(x: f32) -> f32 {
    let x = x.clamp(EXP_LO, EXP_HI);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &c| p.mul_add(r, c));
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' `expf` coefficients, highest degree first (as published).
#[allow(clippy::excessive_precision)]
const EXP_POLY: [f32; 6] =
    [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1];

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Tile, EXP_HI, EXP_LO, EXP_POLY, LN2_HI, LN2_LO, MR, NR};
    use std::arch::x86_64::*;
    use std::f32::consts::LOG2_E;
    const PF: usize = 32;

    /// AVX-512 tiles: `R` rows × 32 columns in 2R accumulators.
    ///
    /// # Safety
    /// As [`super::tile`], on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_avx512(t: Tile) {
        macro_rules! rows {
            ($($r:literal)*) => {
                match t.rows {
                    $($r => tile_avx512_rows::<$r>(t),)*
                    _ => unreachable!("a tile has 1..={MR} rows"),
                }
            };
        }
        rows!(1 2 3 4 5 6 7 8 9 10 11 12)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile_avx512_rows<const R: usize>(Tile { cols, k, a: (a, lda), b, c: (c, ldc), .. }: Tile) {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for d in 0..k {
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add((d + PF) * NR) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add((d + PF) * NR + 16) as *const i8);
            let b0 = _mm512_load_ps(b.add(d * NR));
            let b1 = _mm512_load_ps(b.add(d * NR + 16));
            for (r, acc) in acc.iter_mut().enumerate() {
                let ar = _mm512_set1_ps(*a.add(r * lda + d));
                acc[0] = _mm512_fmadd_ps(ar, b0, acc[0]);
                acc[1] = _mm512_fmadd_ps(ar, b1, acc[1]);
            }
        }
        let masks = [lanes16(cols), lanes16(cols.saturating_sub(16))];
        for (r, acc) in acc.iter().enumerate() {
            let row = c.add(r * ldc);
            for (h, (&v, &mask)) in acc.iter().zip(&masks).enumerate() {
                if mask == u16::MAX {
                    _mm512_storeu_ps(row.add(16 * h), v);
                } else if mask != 0 {
                    _mm512_mask_storeu_ps(row.add(16 * h), mask, v);
                }
            }
        }
    }

    /// [`super::silu_mul`] on whole vectors of 16; returns how many values it did.
    ///
    /// # Safety
    /// On a CPU with AVX-512F; `gate`, `up` and `out` of equal lengths.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
        let whole = out.len() / 16 * 16;
        let c = |v: f32| _mm512_set1_ps(v);
        for i in (0..whole).step_by(16) {
            let g = _mm512_loadu_ps(gate.as_ptr().add(i));
            let x = _mm512_max_ps(_mm512_min_ps(_mm512_sub_ps(c(0.0), g), c(EXP_HI)), c(EXP_LO));
            let n =
                _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, c(LOG2_E)));
            let r = _mm512_fmadd_ps(n, c(-LN2_HI), x);
            let r = _mm512_fmadd_ps(n, c(-LN2_LO), r);
            let mut p = c(EXP_POLY[0]);
            for &k in &EXP_POLY[1..] {
                p = _mm512_fmadd_ps(p, r, c(k));
            }
            let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), c(1.0));
            let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            )));
            let e = _mm512_mul_ps(y, scale);
            let s = _mm512_div_ps(g, _mm512_add_ps(c(1.0), e));
            _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(s, _mm512_loadu_ps(up.as_ptr().add(i))));
        }
        whole
    }

    /// [`super::silu_mul`] on whole vectors of 8; returns how many values it did.
    ///
    /// # Safety
    /// On a CPU with AVX2 and FMA; `gate`, `up` and `out` of equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) -> usize {
        let whole = out.len() / 8 * 8;
        let c = |v: f32| _mm256_set1_ps(v);
        for i in (0..whole).step_by(8) {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let x = _mm256_max_ps(_mm256_min_ps(_mm256_sub_ps(c(0.0), g), c(EXP_HI)), c(EXP_LO));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, c(LOG2_E)));
            let r = _mm256_fmadd_ps(n, c(-LN2_HI), x);
            let r = _mm256_fmadd_ps(n, c(-LN2_LO), r);
            let mut p = c(EXP_POLY[0]);
            for &k in &EXP_POLY[1..] {
                p = _mm256_fmadd_ps(p, r, c(k));
            }
            let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), c(1.0));
            let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            )));
            let e = _mm256_mul_ps(y, scale);
            let s = _mm256_div_ps(g, _mm256_add_ps(c(1.0), e));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i))));
        }
        whole
    }

    fn lanes16(n: usize) -> u16 {
        if n >= 16 {
            u16::MAX
        } else {
            (1u16 << n) - 1
        }
    }

    /// AVX2 tiles: up to 6 rows × 16 columns in 12 accumulators, over every 6-row half of the
    /// block and 16-column half of the panel.
    ///
    /// # Safety
    /// As [`super::tile`], on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2(t: Tile) {
        let ((a, lda), (c, ldc)) = (t.a, t.c);
        for half_cols in 0..t.cols.div_ceil(16) {
            for half_rows in 0..t.rows.div_ceil(6) {
                let part = Tile {
                    rows: (t.rows - 6 * half_rows).min(6),
                    cols: (t.cols - 16 * half_cols).min(16),
                    a: (a.add(6 * half_rows * lda), lda),
                    b: t.b.add(16 * half_cols),
                    c: (c.add(6 * half_rows * ldc + 16 * half_cols), ldc),
                    ..t
                };
                macro_rules! rows {
                    ($($r:literal)*) => {
                        match part.rows {
                            $($r => tile_avx2_rows::<$r>(part),)*
                            _ => unreachable!("an AVX2 tile has 1..=6 rows"),
                        }
                    };
                }
                rows!(1 2 3 4 5 6)
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile_avx2_rows<const R: usize>(Tile { cols, k, a: (a, lda), b, c: (c, ldc), .. }: Tile) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for d in 0..k {
            let b0 = _mm256_load_ps(b.add(d * NR));
            let b1 = _mm256_load_ps(b.add(d * NR + 8));
            for (r, acc) in acc.iter_mut().enumerate() {
                let ar = _mm256_broadcast_ss(&*a.add(r * lda + d));
                acc[0] = _mm256_fmadd_ps(ar, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(ar, b1, acc[1]);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let row = c.add(r * ldc);
            if cols == 16 {
                _mm256_storeu_ps(row, acc[0]);
                _mm256_storeu_ps(row.add(8), acc[1]);
            } else {
                let mut tmp = [0f32; 16];
                _mm256_storeu_ps(tmp.as_mut_ptr(), acc[0]);
                _mm256_storeu_ps(tmp.as_mut_ptr().add(8), acc[1]);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), row, cols);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        // A small LCG: varied magnitudes and signs, so summation order shows in the bits.
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// One `mul_add` chain per element, in ascending `d`: what every kernel must give.
    fn chains(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).fold(0f32, |acc, d| x[i * k + d].mul_add(w[j * k + d], acc));
            }
        }
        y
    }

    #[test]
    fn every_kernel_gives_the_fma_chain_bits_at_every_edge() {
        for (m, n, k) in [(1, 1, 1), (5, 7, 3), (12, 32, 16), (13, 33, 17), (25, 70, 64), (64, 96, 40), (7, 31, 200)] {
            let (x, w) = (values(m * k, 1), values(n * k, 2));
            let want = chains(&x, &w, m, n, k);
            let (mut a, packed) = (PackedRows::default(), PackedMatrix::pack(&w, n, k));
            a.gather(&x, k, 0..m);
            for kernel in Kernel::ALL.into_iter().filter(|k| k.available()) {
                let got = matmul(kernel, &a, &packed);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{} at m={m} n={n} k={k}",
                    kernel.name()
                );
            }
        }
    }

    #[test]
    fn gathered_rows_are_the_chosen_tokens() {
        let (k, n) = (9, 5);
        let x = values(20 * k, 3);
        let w = values(n * k, 4);
        let tokens = [19, 0, 7, 7, 3];
        let rows: Vec<f32> = tokens.iter().flat_map(|&t| x[t * k..(t + 1) * k].to_vec()).collect();
        let mut a = PackedRows::default();
        a.gather(&x, k, tokens.iter().copied());
        let got = matmul(Kernel::best(), &a, &PackedMatrix::pack(&w, n, k));
        assert_eq!(got, chains(&rows, &w, tokens.len(), n, k));
    }

    #[test]
    fn every_kernel_gives_the_same_silu_bits_close_to_libm() {
        let n = 1000; // not a whole number of vectors
        let gate: Vec<f32> =
            values(n, 5).iter().map(|v| v * 30.0).chain([-100.0, 100.0, 0.0, -0.0, 87.5, -88.5]).collect();
        let up = values(gate.len(), 6);
        let mut want = vec![0f32; gate.len()];
        silu_mul(Kernel::Portable, &gate, &up, &mut want);
        for kernel in Kernel::ALL.into_iter().filter(|k| k.available()) {
            let mut got = vec![f32::NAN; gate.len()];
            silu_mul(kernel, &gate, &up, &mut got);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{}",
                kernel.name()
            );
        }
        for ((&g, &u), &got) in gate.iter().zip(&up).zip(&want) {
            let libm = g / (1.0 + (-g).exp()) * u;
            // Relative to libm, or absolute where the clamp makes both vanish (silu(-100) ≈ 0).
            assert!((got - libm).abs() <= 4.0 * f32::EPSILON * libm.abs() + 1e-30, "silu({g}) · {u}: {got} vs {libm}");
        }
    }

    #[test]
    fn the_setting_names_a_kernel_or_says_what_is_wrong() {
        assert_eq!(Kernel::from_setting(None), Ok(Kernel::best()));
        assert_eq!(Kernel::from_setting(Some(" auto ")), Ok(Kernel::best()));
        assert_eq!(Kernel::from_setting(Some("portable")), Ok(Kernel::Portable));
        let unknown = Kernel::from_setting(Some("avx3")).unwrap_err();
        assert_eq!(unknown, KernelError::Unknown("avx3".into()));
        assert_eq!(unknown.to_string(), "MOE_AUDIT_KERNEL must be auto, avx512, avx2 or portable, got \"avx3\"");
        for kernel in Kernel::ALL {
            assert_eq!(Kernel::from_setting(Some(kernel.name())).is_ok(), kernel.available());
        }
    }
}
