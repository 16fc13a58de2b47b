//! What expert parallelism costs on this machine, side by side in one run (medians, rotating
//! order so that noise hits both sides alike):
//!
//! 1. all-to-all throughput: every rank sends `PAYLOAD` bytes split evenly over the ranks (the
//!    uniform-routing dispatch of docs/ROUTING.md, expert parallelism), against one plain memcpy of all those bytes;
//! 2. the expert-parallel layer forward against the single-device `MoeLayer::forward` (T = 2048
//!    tokens, H 512, FFN 1024, E 8, k 2: the `mixtral` preset), checked equal first.
//!
//! The last line is `a2a_vs_memcpy=<memcpy time / all-to-all time>` for 4 ranks.
//!
//! In-process ranks: `cargo run --release --example a2a_cost [-- --reps N]`.
//! MPI ranks (one per process, shared memory on one machine):
//! `cargo build --release --features mpi --example a2a_cost &&
//!  mpirun -np 4 --oversubscribe target/release/examples/a2a_cost --comm mpi` (rank 0 prints).

#[path = "common/timing.rs"]
mod timing;

use candle_core::{DType, Device, Tensor};
use moe_audit::config::preset;
use moe_audit::layer::{MoeLayer, Seeded};
use moe_audit::parallel::{run_ranks, split_batch, Communicator, ExpertParallel};
use std::hint::black_box;
use std::time::{Duration, Instant};
use timing::{median, ms};

/// Bytes each rank sends per all-to-all: 2048 tokens × k 2 × H 512 × 4 bytes (8 MiB).
const PAYLOAD: usize = 2048 * 2 * 512 * 4;
const WARMUP: usize = 3;
const BATCH: usize = 4;
const SEQ: usize = 512;
const HIDDEN: usize = 512;
const FFN: usize = 1024;

/// Median (all-to-all, memcpy) times on this communicator; memcpy runs on rank 0 while the
/// others wait at a barrier, over all the bytes the all-to-all moves.
fn a2a_vs_memcpy(comm: &dyn Communicator, reps: usize) -> moe_audit::Result<(Duration, Duration)> {
    let r = comm.size();
    let values = PAYLOAD / 4;
    let rows = vec![values / r / 512; r];
    let send: Vec<f32> = (0..values).map(|i| i as f32).collect();
    let total = vec![1f32; values * r];
    let mut dst = vec![0f32; values * r];
    let (mut a2a, mut copy) = (Vec::new(), Vec::new());
    for rep in 0..WARMUP + reps {
        for slot in 0..2 {
            // The all-to-all takes its send buffer by value: hand it a copy made off the clock.
            let buf = send.clone();
            comm.barrier()?;
            let start = Instant::now();
            if (rep + slot) % 2 == 0 {
                black_box(comm.all_to_all_rows(buf, 512, &rows, &rows)?);
                comm.barrier()?;
                if rep >= WARMUP {
                    a2a.push(start.elapsed());
                }
            } else {
                if comm.rank() == 0 {
                    dst.copy_from_slice(black_box(&total));
                    black_box(&dst);
                }
                comm.barrier()?;
                if rep >= WARMUP {
                    copy.push(start.elapsed());
                }
            }
        }
    }
    Ok((median(a2a), median(copy)))
}

/// Median (expert-parallel, single-device) forward times; the outputs are checked equal first.
fn ep_vs_single(
    comm: &dyn Communicator,
    layer: &MoeLayer,
    x: &Tensor,
    reps: usize,
) -> moe_audit::Result<(Duration, Duration)> {
    let per = split_batch(BATCH, comm.size())?;
    let mine = x.narrow(0, comm.rank() * per, per)?;
    let ep = ExpertParallel::new(layer);
    let gathered = ep.forward_gathered(comm, x)?;
    let (y, _) = layer.forward(x)?;
    let bits = |t: &Tensor| {
        t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map(|v| v.into_iter().map(f32::to_bits).collect::<Vec<_>>())
    };
    assert_eq!(bits(&gathered.y)?, bits(&y)?, "expert-parallel output differs from the single-device output");
    let (mut par, mut single) = (Vec::new(), Vec::new());
    for rep in 0..WARMUP + reps {
        for slot in 0..2 {
            comm.barrier()?;
            let start = Instant::now();
            if (rep + slot) % 2 == 0 {
                black_box(ep.forward(comm, &mine)?);
                comm.barrier()?;
                if rep >= WARMUP {
                    par.push(start.elapsed());
                }
            } else {
                if comm.rank() == 0 {
                    black_box(layer.forward(x)?);
                }
                comm.barrier()?;
                if rep >= WARMUP {
                    single.push(start.elapsed());
                }
            }
        }
    }
    Ok((median(par), median(single)))
}

fn report(
    comm: &dyn Communicator,
    layer: &MoeLayer,
    x: &Tensor,
    reps: usize,
    label: &str,
) -> moe_audit::Result<Option<f64>> {
    let (a2a, copy) = a2a_vs_memcpy(comm, reps)?;
    let (ep, single) = ep_vs_single(comm, layer, x, reps)?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    let r = comm.size();
    let gib = (PAYLOAD * r) as f64 / (1u64 << 30) as f64;
    println!(
        "{label} {r} ranks: all-to-all {:7.2} ms ({:5.1} GiB/s) | memcpy {:7.2} ms ({:5.1} GiB/s) | memcpy/a2a {:.3}",
        ms(a2a),
        gib / a2a.as_secs_f64(),
        ms(copy),
        gib / copy.as_secs_f64(),
        copy.as_secs_f64() / a2a.as_secs_f64()
    );
    println!(
        "{label} {r} ranks: EP forward {:7.2} ms | single-device forward {:7.2} ms | single/EP {:.3} (T={} H={HIDDEN} FFN={FFN} E=8 k=2)",
        ms(ep),
        ms(single),
        single.as_secs_f64() / ep.as_secs_f64(),
        BATCH * SEQ
    );
    Ok(Some(copy.as_secs_f64() / a2a.as_secs_f64()))
}

fn main() -> moe_audit::Result<()> {
    let reps = timing::reps(9).map_err(moe_audit::Error::usage)?;
    let mpi = timing::flag("--comm").map_err(moe_audit::Error::usage)?.as_deref() == Some("mpi");
    let layer =
        MoeLayer::seeded(preset("mixtral").expect("preset").config()?, HIDDEN, FFN, 0, DType::F32, &Device::Cpu)?;
    let x = Seeded::new(1).normal(&[BATCH, SEQ, HIDDEN], &Device::Cpu)?;
    let mut last = None;
    if mpi {
        #[cfg(feature = "mpi")]
        {
            let comm = moe_audit::parallel::mpi::MpiComm::init()?;
            last = report(&comm, &layer, &x, reps, "mpi")?;
            if last.is_none() {
                return Ok(());
            }
        }
        #[cfg(not(feature = "mpi"))]
        panic!("--comm mpi needs --features mpi");
    } else {
        for r in [2, 4] {
            last = run_ranks(r, |comm| report(comm, &layer, &x, reps, "in-process"))?.swap_remove(0);
        }
    }
    println!("a2a_vs_memcpy={:.3}", last.expect("rank 0 reports"));
    Ok(())
}
