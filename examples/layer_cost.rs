//! What the MoE layer forward costs on CPU, f32, against its references (the setup of
//! `benches/common/layer_case.rs`, shared with `cargo bench --bench layer`), and with `--torch`
//! against PyTorch (`benches/torch_block.py`, run as a child process that times one forward per
//! request, so that both sides are measured in one run).
//!
//! After a warm-up, each repetition runs every implementation once, in a rotating order so that
//! noise hits all alike, each after [`SETTLE`] of idle time; the reported time is the median over
//! repetitions. The rotation also
//! measures the machine's peak: fused multiply-adds on every thread with the widest vectors the
//! CPU has. Each size's line gives the times and the ratios of the references to ours; the dense
//! FFN's GFLOP/s are stated against that peak. The last line is `moe_vs_dense=<dense/moe>
//! moe_vs_mixtral=<mixtral/moe>` (and with `--torch`, `moe_vs_torch=<torch moe/moe>
//! dense_vs_torch=<torch dense/dense>`), each the minimum over both sizes.
//!
//! Run: `cargo run --release --example layer_cost [-- --reps N] [--torch] [--experts E] [--only NAME]`
//! (`MOE_AUDIT_KERNEL=avx2` times the fallback kernel; `RAYON_NUM_THREADS=1` runs both sides on
//! one thread).

#[path = "../benches/common/layer_case.rs"]
mod layer_case;
#[path = "common/timing.rs"]
mod timing;

use candle_core::Device;
use layer_case::{LayerCase, BATCH, FFN, HIDDEN, SEQ, SIZES, TOP_K};
use moe_audit::layer::Kernel;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};
use timing::{median, ms};

const WARMUP: usize = 3;
/// Idle time before each measurement, so that threads left spinning by the one before (OpenMP's
/// in the PyTorch child, rayon's here) have gone to sleep and time nothing of the next.
const SETTLE: Duration = Duration::from_millis(100);
/// How long the PyTorch side may take to answer one request (its setup builds E = 64's weights).
const TORCH_TIMEOUT: Duration = Duration::from_secs(300);

/// The implementations, in the order of the columns.
const NAMES: [&str; 6] = ["moe", "dense", "dense-candle", "mixtral", "torch-moe", "torch-dense"];

/// `benches/torch_block.py --serve` as a child process.
struct Torch {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<std::io::Result<String>>,
}

impl Torch {
    /// With as many threads as our pool (`torch.set_num_threads`).
    fn start(threads: usize) -> Result<Self, String> {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_block.py");
        let mut child = Command::new("python3")
            .args([script, "--serve", "--threads", &threads.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start python3 {script}: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (send, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self { child, stdin, lines })
    }

    fn ask(&mut self, request: &str) -> Result<String, String> {
        writeln!(self.stdin, "{request}").and_then(|_| self.stdin.flush()).map_err(|e| format!("torch: {e}"))?;
        match self.lines.recv_timeout(TORCH_TIMEOUT) {
            Ok(Ok(line)) if !line.starts_with("error") => Ok(line),
            Ok(Ok(line)) => Err(format!("torch: {line}")),
            Ok(Err(e)) => Err(format!("torch: {e}")),
            Err(_) => Err(format!("torch: no answer to `{request}` within {TORCH_TIMEOUT:?}")),
        }
    }

    /// One timed forward of `which` (`moe` or `dense`), as PyTorch measured it.
    fn run(&mut self, which: &str) -> Result<Duration, String> {
        let line = self.ask(&format!("run {which}"))?;
        line.trim().parse::<f64>().map(Duration::from_secs_f64).map_err(|e| format!("torch answered {line:?}: {e}"))
    }
}

impl Drop for Torch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Median times, by [`NAMES`] (the PyTorch ones only with `torch`), and the median peak in
/// GFLOP/s, measured in the rotation too so that the same load weighs on it.
fn measure(
    case: &LayerCase,
    mut torch: Option<&mut Torch>,
    reps: usize,
    only: Option<&str>,
) -> Result<(Vec<Option<Duration>>, f64), String> {
    let slots = if torch.is_some() { NAMES.len() + 1 } else { 5 };
    let peak_slot = slots - 1;
    let mut peaks = Vec::new();
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); NAMES.len()];
    let err = |e: candle_core::Error| e.to_string();
    for rep in 0..WARMUP + reps {
        for slot in 0..slots {
            let which = (rep + slot) % slots;
            std::thread::sleep(SETTLE);
            if which == peak_slot {
                let gflops = peak_gflops();
                if rep >= WARMUP {
                    peaks.push(gflops);
                }
                continue;
            }
            if only.is_some_and(|o| o != NAMES[which]) {
                continue;
            }
            let start = Instant::now();
            let elapsed = match which {
                0 => case.moe().map_err(err).map(drop),
                1 => case.dense().map_err(err).map(drop),
                2 => case.dense_candle().map_err(err).map(drop),
                3 => case.mixtral().map_err(err).map(drop),
                _ => Ok(()),
            }
            .map(|()| start.elapsed());
            let elapsed = match (which, torch.as_deref_mut()) {
                (4, Some(t)) => t.run("moe")?,
                (5, Some(t)) => t.run("dense")?,
                _ => elapsed?,
            };
            if rep >= WARMUP {
                samples[which].push(elapsed);
            }
        }
    }
    peaks.sort_by(f64::total_cmp);
    let peak = peaks[peaks.len() / 2];
    Ok((samples.into_iter().map(|s| (!s.is_empty()).then(|| median(s))).collect(), peak))
}

/// The machine's peak f32 GFLOP/s: independent FMA chains on every thread of the pool.
fn peak_gflops() -> f64 {
    let start = Instant::now();
    let flops: f64 = rayon::broadcast(|_| fma_flops(2_000_000)).into_iter().sum();
    flops / start.elapsed().as_secs_f64() / 1e9
}

/// FLOPs of `iters` rounds of independent FMAs in the widest vectors this CPU has.
fn fma_flops(iters: usize) -> f64 {
    // Twelve chains, each its own local, so they stay in registers (an array would be kept in
    // memory, and the loop would time store-to-load forwarding instead of the FMA units).
    macro_rules! chains {
        ($n:expr, $c:ident => $fma:expr, $v:expr) => {
            chains!($n, $c => $fma, $v, c0 c1 c2 c3 c4 c5 c6 c7 c8 c9 c10 c11)
        };
        ($n:expr, $c:ident => $fma:expr, $v:expr, $($x:ident)*) => {{
            $(let mut $x = $v;)*
            for _ in 0..$n {
                $($x = { let $c = $x; $fma };)*
            }
            std::hint::black_box(($($x,)*));
        }};
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f")]
        fn avx512(iters: usize) {
            let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            chains!(iters, c => _mm512_fmadd_ps(c, a, b), _mm512_set1_ps(1.0));
        }
        #[target_feature(enable = "avx2,fma")]
        fn avx2(iters: usize) {
            let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
            chains!(iters, c => _mm256_fmadd_ps(c, a, b), _mm256_set1_ps(1.0));
        }
        if Kernel::Avx512.available() {
            // SAFETY: the CPU has AVX-512F.
            unsafe { avx512(iters) };
            return (iters * 12 * 16 * 2) as f64;
        }
        if Kernel::Avx2.available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { avx2(iters) };
            return (iters * 12 * 8 * 2) as f64;
        }
    }
    chains!(iters, c => c.mul_add(0.999_999, 1e-7), 1f32);
    (iters * 12 * 2) as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let reps = timing::reps(15)?.max(1);
    let with_torch = std::env::args().any(|a| a == "--torch");
    // `--only moe` (or another column) runs that one alone, e.g. under `perf record`.
    let only = timing::flag("--only")?;
    if let Some(o) = only.as_deref().filter(|o| !NAMES.contains(o)) {
        return Err(format!("--only {o}: expected one of {}", NAMES.join(", ")).into());
    }
    let sizes: Vec<usize> = match timing::flag("--experts")? {
        Some(e) => vec![e.parse().map_err(|err| format!("--experts {e}: {err}"))?],
        None => SIZES.to_vec(),
    };
    let threads = rayon::current_num_threads();
    let kernel = Kernel::selected();
    println!(
        "MoE layer forward, CPU f32, {threads} threads, {} kernel: T={} (batch {BATCH} x seq {SEQ}), H={HIDDEN}, FFN={FFN}, k={TOP_K}, dense FFN={}; median of {reps} after {WARMUP} warm-up",
        kernel.name(),
        BATCH * SEQ,
        TOP_K * FFN
    );
    let dense_flops = 2.0 * (BATCH * SEQ * HIDDEN * 3 * TOP_K * FFN) as f64;
    let mut torch = if with_torch { Some(Torch::start(threads)?) } else { None };
    let mut worst = [f64::INFINITY; 4]; // dense/moe, mixtral/moe, torch-moe/moe, torch-dense/dense
    for experts in sizes {
        let case = LayerCase::new(experts, &Device::Cpu)?;
        if let Some(t) = torch.as_mut() {
            t.ask(&format!("setup {experts}"))?;
        }
        let (times, peak) = measure(&case, torch.as_mut(), reps, only.as_deref())?;
        let at = |i: usize| times[i].map_or(f64::NAN, |t| t.as_secs_f64());
        let ratios = [at(1) / at(0), at(3) / at(0), at(4) / at(0), at(5) / at(1)];
        worst.iter_mut().zip(ratios).for_each(|(w, r)| *w = w.min(r));
        let columns: Vec<String> =
            NAMES.iter().zip(&times).filter_map(|(n, t)| t.map(|t| format!("{n} {:7.2} ms", ms(t)))).collect();
        let gflops = dense_flops / at(1) / 1e9;
        let mut line = format!(
            "E={experts:<2} k={TOP_K}: {} | dense/moe {:.3} | mixtral/moe {:.3} | dense {gflops:.0} GFLOP/s ({:.0}% of the peak, {peak:.0})",
            columns.join(" | "),
            ratios[0],
            ratios[1],
            100.0 * gflops / peak
        );
        if with_torch {
            line += &format!(
                " | torch-moe/moe {:.3} | torch-dense/dense {:.3} (torch dense {:.0} GFLOP/s)",
                ratios[2],
                ratios[3],
                dense_flops / at(5) / 1e9
            );
        }
        println!("{line}");
        println!(
            "       outputs: moe vs candle's Mixtral block {:.1e}, dense vs candle's {:.1e} (max |diff| / max |y|)",
            case.moe_diff, case.dense_diff
        );
    }
    let mut last = format!("moe_vs_dense={:.3} moe_vs_mixtral={:.3}", worst[0], worst[1]);
    if with_torch {
        last += &format!(" moe_vs_torch={:.3} dense_vs_torch={:.3}", worst[2], worst[3]);
    }
    println!("{last}");
    Ok(())
}
