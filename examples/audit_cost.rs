//! What a full audit costs against one forward pass of the audited layer, at two lengths.
//!
//! The layer: the `megatron-probs` preset widened to E = 64 (top-2, capacity factor 1, so
//! capacity binds and every probe has work), H 512, expert FFN 1024, seeded weights, CPU f32.
//! The audit: all default probes (P searched, F/N/R with 32 trials each, D, S, M, L), the score
//! stage's per-token check, and the layer sample, on T = 2048 tokens (batch 4 × seq 512: four
//! sequences, so the neighbour and re-batch probes apply), then T = 8192 (batch 4 × seq 2048).
//! The forward: `MoeLayer::forward` on the same hidden states.
//!
//! Each repetition times one forward and one audit back to back (order alternating); medians.
//! One line `audit_over_forward=<median audit / median forward> (T=<tokens>)` per length, after
//! where the audit's time went: the setup (hidden states, base routing, score check, purity
//! check, layer sample) and each probe with its layer sample case and witness (medians, from the
//! audit's progress reports).
//!
//! Run: `cargo run --release --example audit_cost [-- --reps N] [--seq-lens 512,2048]
//! [--probes P,F] [--exhaustive]`.

#[path = "common/timing.rs"]
mod timing;

use candle_core::{DType, Device};
use moe_audit::analyze::{audit, AuditOptions, Subject};
use moe_audit::layer::{MoeLayer, Seeded};
use moe_audit::progress::Progress;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use timing::{median, ms};

const BATCH: usize = 4;
const HIDDEN: usize = 512;
const FFN: usize = 1024;
const EXPERTS: usize = 64;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let reps = timing::reps(5)?;
    let mut config = moe_audit::config::preset("megatron-probs").ok_or("no megatron-probs preset")?.config()?;
    config.experts = EXPERTS;
    let layer = MoeLayer::seeded(config, HIDDEN, FFN, 0, DType::F32, &Device::Cpu)?;
    let seq_lens = timing::flag("--seq-lens")?.unwrap_or_else(|| "512,2048".into());
    for seq in seq_lens.split(',') {
        let seq: usize = seq.trim().parse().map_err(|e| format!("--seq-lens {seq}: {e}"))?;
        let x = Seeded::new(0).normal(&[BATCH, seq, HIDDEN], &Device::Cpu)?;
        let mut options = AuditOptions { batch: BATCH, seq_len: seq, ..AuditOptions::default() };
        if let Some(list) = timing::flag("--probes")? {
            options.probes = moe_audit::analyze::Probe::parse_list(&list)?;
        }
        options.exhaustive = std::env::args().any(|a| a == "--exhaustive");
        println!(
            "audit vs forward, CPU f32: megatron-probs E={EXPERTS} k=2, T={} (batch {BATCH} x seq {seq}), H={HIDDEN}, FFN={FFN}, probes {:?}{}, {} trials; median of {reps}",
            BATCH * seq,
            options.probes,
            if options.exhaustive { " (exhaustive P)" } else { "" },
            options.trials
        );
        let (mut forward, mut audits) = (Vec::new(), Vec::new());
        let mut parts: Vec<(String, Vec<Duration>)> = Vec::new();
        let mut leaks = 0;
        for rep in 0..reps + 1 {
            for step in 0..2 {
                let start = Instant::now();
                if (rep + step) % 2 == 0 {
                    layer.forward(&x)?;
                    if rep > 0 {
                        forward.push(start.elapsed());
                    }
                } else {
                    let clock = Clock { start, marks: Mutex::default() };
                    let report = audit(&Subject::layer(&layer), &options, &clock)?;
                    let end = start.elapsed();
                    if rep > 0 {
                        audits.push(end);
                        for (i, (label, took)) in clock.parts(end).into_iter().enumerate() {
                            if parts.len() == i {
                                parts.push((label, Vec::new()));
                            }
                            parts[i].1.push(took);
                        }
                    }
                    leaks = report.findings.iter().filter(|f| f.verdict == moe_audit::analyze::Verdict::Leak).count();
                }
            }
        }
        let (f, a) = (median(forward), median(audits));
        for (label, took) in parts {
            println!("  {label:<18} {:8.1} ms", ms(median(took)));
        }
        println!(
            "forward {:.1} ms | audit {:.1} ms ({leaks} probes leak)",
            f.as_secs_f64() * 1e3,
            a.as_secs_f64() * 1e3
        );
        println!("audit_over_forward={:.3} (T={})", a.as_secs_f64() / f.as_secs_f64(), BATCH * seq);
    }
    Ok(())
}

/// Records when each probe starts, to split an audit's time into its setup and its probes.
struct Clock {
    start: Instant,
    marks: Mutex<Vec<(String, Duration)>>,
}

impl Clock {
    /// (setup or probe, time taken) of an audit that ended at `end`.
    fn parts(self, end: Duration) -> Vec<(String, Duration)> {
        let marks = self.marks.into_inner().expect("marks");
        let mut out = vec![("setup".to_string(), marks.first().map_or(end, |m| m.1))];
        for (i, (label, at)) in marks.iter().enumerate() {
            let next = marks.get(i + 1).map_or(end, |m| m.1);
            out.push((label.clone(), next - *at));
        }
        out
    }
}

impl Progress for Clock {
    fn probe(&self, label: &str) {
        self.marks.lock().expect("marks").push((label.to_string(), self.start.elapsed()));
    }
    fn plan(&self, _: usize) {}
    fn done(&self, _: usize) {}
}
