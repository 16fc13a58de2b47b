//! What the reductions cost on this machine, side by side in one run (medians, rotating order so
//! that noise hits every side alike): an all-reduce of `PAYLOAD` bytes per rank with each
//! algorithm (f32 wire and accumulator, and f16 wire with an f32 accumulator), against one plain
//! memcpy of the bytes a ring all-reduce moves, `2·B·(R−1)/R` per rank, on rank 0 while the
//! others wait at a barrier (the `a2a_cost` baseline).
//!
//! The last line is `reduce_vs_memcpy=<memcpy time / ring f32 all-reduce time>` for 4 ranks.
//!
//! In-process ranks: `cargo run --release --example reduce_cost [-- --reps N]`.
//! MPI ranks: `cargo build --release --features mpi --example reduce_cost &&
//!  mpirun -np 4 --oversubscribe target/release/examples/reduce_cost --comm mpi` (rank 0 prints).

#[path = "common/timing.rs"]
mod timing;

use moe_audit::parallel::reduce::{all_reduce, Algorithm, Precision, ReducePlan};
use moe_audit::parallel::{run_ranks, Communicator};
use std::hint::black_box;
use std::time::{Duration, Instant};
use timing::{median, ms};

/// Bytes each rank reduces in f32: 2M values (8 MiB), a mid-sized gradient bucket.
const PAYLOAD: usize = 8 << 20;
const WARMUP: usize = 2;

fn plans(ranks: usize) -> Vec<ReducePlan> {
    let mut out = Vec::new();
    for (wire, accumulate) in [(Precision::F32, Precision::F32), (Precision::F16, Precision::F32)] {
        for algorithm in Algorithm::ALL {
            out.push(ReducePlan { algorithm, wire, accumulate, domain: if ranks >= 4 { 2 } else { 1 } });
        }
    }
    out
}

/// Median time of each plan's all-reduce, then of the memcpy (last).
fn measure(comm: &dyn Communicator, reps: usize) -> moe_audit::Result<Vec<Duration>> {
    let r = comm.size();
    let values = PAYLOAD / 4;
    let input: Vec<f32> = (0..values).map(|i| ((i * 7 + comm.rank()) % 1000) as f32 * 1e-3).collect();
    let moved = 2 * PAYLOAD * (r - 1) / r / 4;
    let src = vec![1f32; moved];
    let mut dst = vec![0f32; moved];
    let plans = plans(r);
    let mut times = vec![Vec::new(); plans.len() + 1];
    for rep in 0..WARMUP + reps {
        for slot in 0..times.len() {
            let which = (rep + slot) % times.len();
            comm.barrier()?;
            let start = Instant::now();
            if which < plans.len() {
                black_box(all_reduce(comm, &input, plans[which])?);
            } else if comm.rank() == 0 {
                dst.copy_from_slice(black_box(&src));
                black_box(&dst);
            }
            comm.barrier()?;
            if rep >= WARMUP {
                times[which].push(start.elapsed());
            }
        }
    }
    Ok(times.into_iter().map(median).collect())
}

fn report(comm: &dyn Communicator, reps: usize, label: &str) -> moe_audit::Result<Option<f64>> {
    let times = measure(comm, reps)?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    let r = comm.size();
    let copy = *times.last().expect("memcpy measured");
    let gib = |bytes: f64, t: Duration| bytes / (1u64 << 30) as f64 / t.as_secs_f64();
    let moved = 2.0 * PAYLOAD as f64 * (r - 1) as f64 / r as f64;
    println!("{label} {r} ranks: memcpy of 2B(R-1)/R {:8.2} ms ({:5.1} GiB/s)", ms(copy), gib(moved, copy));
    for (p, t) in plans(r).iter().zip(&times) {
        println!(
            "{label} {r} ranks: all-reduce {:<12} wire {:<4} acc {:<4} {:8.2} ms (algorithm bandwidth {:5.2} GiB/s of f32 input) | memcpy/all-reduce {:.3}",
            p.algorithm.name(),
            p.wire.name(),
            p.accumulate.name(),
            ms(*t),
            gib(PAYLOAD as f64, *t),
            copy.as_secs_f64() / t.as_secs_f64()
        );
    }
    Ok(Some(copy.as_secs_f64() / times[0].as_secs_f64()))
}

fn main() -> moe_audit::Result<()> {
    let reps = timing::reps(7).map_err(moe_audit::Error::Usage)?;
    let mpi = timing::flag("--comm").map_err(moe_audit::Error::Usage)?.as_deref() == Some("mpi");
    let mut last = None;
    if mpi {
        #[cfg(feature = "mpi")]
        {
            let comm = moe_audit::parallel::mpi::MpiComm::init()?;
            last = report(&comm, reps, "mpi")?;
            if last.is_none() {
                return Ok(());
            }
        }
        #[cfg(not(feature = "mpi"))]
        panic!("--comm mpi needs --features mpi");
    } else {
        for r in [2, 4] {
            last = run_ranks(r, |comm| report(comm, reps, "in-process"))?.swap_remove(0);
        }
    }
    println!("reduce_vs_memcpy={:.3}", last.expect("rank 0 reports"));
    Ok(())
}
