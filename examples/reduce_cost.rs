//! What the reductions cost on this machine, side by side in one run (medians, rotating order so
//! that noise hits every side alike): on `PAYLOAD` bytes of f32 per rank, the all-reduce and the
//! reduce-scatter with each algorithm and the (ring) all-gather, each with an f32, bf16 and f16
//! wire (f32 accumulator), against one plain memcpy of the bytes the standard formulas say the
//! op moves in f32 (all-reduce `2·B·(R−1)/R` per rank, reduce-scatter and all-gather
//! `B·(R−1)/R`), on rank 0 while the others wait at a barrier (the `a2a_cost` baseline).
//!
//! The last line is `reduce_vs_memcpy=<memcpy time / ring f32 all-reduce time>` for 4 ranks.
//!
//! In-process ranks: `cargo run --release --example reduce_cost [-- --reps N]`.
//! MPI ranks: `cargo build --release --features mpi --example reduce_cost &&
//!  mpirun -np 4 --oversubscribe target/release/examples/reduce_cost --comm mpi` (rank 0 prints).

#[path = "common/timing.rs"]
mod timing;

use moe_audit::parallel::reduce::{all_gather, all_reduce, chunk, reduce_scatter, Algorithm, Precision, ReducePlan};
use moe_audit::parallel::{run_ranks, Communicator};
use std::hint::black_box;
use std::time::{Duration, Instant};
use timing::{median, ms};

/// Bytes each rank reduces in f32: 2M values (8 MiB), a mid-sized gradient bucket.
const PAYLOAD: usize = 8 << 20;
const WARMUP: usize = 2;

/// One collective timed.
#[derive(Clone, Copy)]
enum Op {
    AllReduce(ReducePlan),
    ReduceScatter(ReducePlan),
    AllGather(Precision),
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce(_) => "all-reduce",
            Op::ReduceScatter(_) => "reduce-scatter",
            Op::AllGather(_) => "all-gather",
        }
    }

    fn wire(self) -> Precision {
        match self {
            Op::AllReduce(p) | Op::ReduceScatter(p) => p.wire,
            Op::AllGather(wire) => wire,
        }
    }

    fn algorithm(self) -> &'static str {
        match self {
            Op::AllReduce(p) | Op::ReduceScatter(p) => p.algorithm.name(),
            Op::AllGather(_) => "ring",
        }
    }

    /// f32 bytes the standard formula says one rank moves, over `B·(R−1)/R`.
    fn passes(self) -> usize {
        match self {
            Op::AllReduce(_) => 2,
            Op::ReduceScatter(_) | Op::AllGather(_) => 1,
        }
    }
}

/// The ring f32 all-reduce first (the last line's ratio).
fn ops(ranks: usize) -> Vec<Op> {
    let mut out = Vec::new();
    let domain = if ranks >= 4 { 2 } else { 1 };
    for wire in Precision::ALL {
        let plan = |algorithm| ReducePlan { algorithm, wire, accumulate: Precision::F32, domain };
        out.extend(Algorithm::ALL.map(|a| Op::AllReduce(plan(a))));
        out.extend(Algorithm::ALL.map(|a| Op::ReduceScatter(plan(a))));
        out.push(Op::AllGather(wire));
    }
    out
}

/// Median time of each op, then of the memcpy of `B·(R−1)/R` and of twice that (last two).
fn measure(comm: &dyn Communicator, reps: usize) -> moe_audit::Result<Vec<Duration>> {
    let r = comm.size();
    let values = PAYLOAD / 4;
    let input: Vec<f32> = (0..values).map(|i| ((i * 7 + comm.rank()) % 1000) as f32 * 1e-3).collect();
    let share = input[chunk(values, r, comm.rank())].to_vec();
    let moved = 2 * PAYLOAD * (r - 1) / r / 4;
    let src = vec![1f32; moved];
    let mut dst = vec![0f32; moved];
    let ops = ops(r);
    let mut times = vec![Vec::new(); ops.len() + 2];
    for rep in 0..WARMUP + reps {
        for slot in 0..times.len() {
            let which = (rep + slot) % times.len();
            comm.barrier()?;
            let start = Instant::now();
            match ops.get(which) {
                Some(Op::AllReduce(plan)) => drop(black_box(all_reduce(comm, &input, *plan)?)),
                Some(Op::ReduceScatter(plan)) => drop(black_box(reduce_scatter(comm, &input, *plan)?)),
                Some(Op::AllGather(wire)) => drop(black_box(all_gather(comm, &share, values, *wire)?)),
                None if comm.rank() == 0 => {
                    let n = moved / (ops.len() + 2 - which);
                    dst[..n].copy_from_slice(black_box(&src[..n]));
                    black_box(&dst);
                }
                None => {}
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
    let gib = |bytes: f64, t: Duration| bytes / (1u64 << 30) as f64 / t.as_secs_f64();
    let once = PAYLOAD as f64 * (r - 1) as f64 / r as f64;
    let copies = [times[times.len() - 2], times[times.len() - 1]];
    for (passes, copy) in [1, 2].into_iter().zip(copies) {
        let bytes = passes as f64 * once;
        println!("{label} {r} ranks: memcpy of {passes}B(R-1)/R {:8.2} ms ({:5.1} GiB/s)", ms(copy), gib(bytes, copy));
    }
    for (op, t) in ops(r).iter().zip(&times) {
        println!(
            "{label} {r} ranks: {:<14} {:<12} wire {:<4} acc f32 {:8.2} ms (algorithm bandwidth {:5.2} GiB/s of f32 input) | memcpy/op {:.3}",
            op.name(),
            op.algorithm(),
            op.wire().name(),
            ms(*t),
            gib(PAYLOAD as f64, *t),
            copies[op.passes() - 1].as_secs_f64() / t.as_secs_f64()
        );
    }
    Ok(Some(copies[1].as_secs_f64() / times[0].as_secs_f64()))
}

fn main() -> moe_audit::Result<()> {
    let reps = timing::reps(7).map_err(moe_audit::Error::usage)?;
    let mpi = timing::flag("--comm").map_err(moe_audit::Error::usage)?.as_deref() == Some("mpi");
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
