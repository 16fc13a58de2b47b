//! Reductions on a [`Communicator`]: all-reduce, reduce-scatter and all-gather of f32/bf16/f16
//! buffers with the algorithms real libraries use, the accumulation precision separate from the
//! wire precision (README: the GPT-4 failure).
//!
//! Every byte moves through [`Communicator::send_recv`] and every addition happens here, in an
//! order fixed by the algorithm alone: in-process ranks and MPI give the same bits. Values are
//! carried as `f32` holding numbers of the precision they are in (wire or accumulator); an addition
//! is computed in `f32` and rounded once to the accumulator, which is exactly the narrower format's
//! own addition (`f32` has more than twice the significand bits of f16 and bf16 plus two, so
//! double rounding cannot differ). A partial sum that travels is rounded to the wire precision:
//! in a ring every addition is followed by that rounding, whatever the accumulator.

use super::comm::Communicator;
use half::{bf16, f16};
use moe_audit_core::error::{Error, Result};
use serde::Serialize;
use std::cell::Cell;
use std::ops::Range;

/// A floating-point format on the wire or in the accumulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// IEEE binary32.
    F32,
    /// bfloat16: f32's exponent, 8 significand bits.
    Bf16,
    /// IEEE binary16: 11 significand bits, largest finite 65504.
    F16,
}

impl Precision {
    /// Every precision, widest first.
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::Bf16, Precision::F16];

    /// `x` rounded to this precision (to nearest, ties to even; overflow to ±inf).
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::F32 => x,
            Precision::Bf16 => bf16::from_f32(x).to_f32(),
            Precision::F16 => f16::from_f32(x).to_f32(),
        }
    }

    /// Every value of `values` rounded to this precision (f32: left as it is, no pass).
    fn round_all(self, values: &mut [f32]) {
        if self != Precision::F32 {
            values.iter_mut().for_each(|v| *v = self.round(*v));
        }
    }

    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 | Precision::F16 => 2,
        }
    }

    /// The name used in reports (`f32`, `bf16`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// What the format is, in a few words (the command line's help).
    pub fn about(self) -> &'static str {
        match self {
            Precision::F32 => "IEEE binary32",
            Precision::Bf16 => "bfloat16: f32's exponent, 8 significand bits",
            Precision::F16 => "IEEE binary16: 11 significand bits, largest finite 65504",
        }
    }

    /// `values` rounded to this precision, as little-endian bytes (one pass: rounding twice is
    /// rounding once).
    fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; values.len() * self.bytes()];
        let chunks = out.chunks_exact_mut(self.bytes()).zip(values);
        match self {
            Precision::F32 => chunks.for_each(|(b, v)| b.copy_from_slice(&v.to_le_bytes())),
            Precision::Bf16 => chunks.for_each(|(b, &v)| b.copy_from_slice(&bf16::from_f32(v).to_le_bytes())),
            Precision::F16 => chunks.for_each(|(b, &v)| b.copy_from_slice(&f16::from_f32(v).to_le_bytes())),
        }
        out
    }

    /// The values `bytes` encode (one loop per precision, so each is a plain loop).
    fn decode(self, bytes: &[u8]) -> Vec<f32> {
        let chunks = bytes.chunks_exact(self.bytes());
        match self {
            Precision::F32 => chunks.map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Precision::Bf16 => chunks.map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Precision::F16 => chunks.map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        }
    }
}

/// How the partial sums travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// Ring (NCCL, Horovod): reduce-scatter then all-gather around the ring; each chunk's partial
    /// sum travels rank to rank and is rounded to the wire at every hop.
    Ring,
    /// Recursive halving then doubling (Rabenseifner, MPICH): log2 R exchanges with partners at
    /// halving distances; a rank keeps its half in the accumulator. Ranks beyond the largest power
    /// of two first fold their buffer into a partner.
    Halving,
    /// Hierarchical (NCCL across NVLink domains): ring reduce-scatter within a domain, ring
    /// all-reduce of each shard across domains, ring all-gather within the domain.
    Hierarchical,
    /// Direct (all-to-all) reduce-scatter: every rank sends each chunk straight to its owner,
    /// which sums the R contributions in the accumulator, in rank order; then an all-gather.
    Direct,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 4] = [Algorithm::Ring, Algorithm::Halving, Algorithm::Hierarchical, Algorithm::Direct];

    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Halving => "halving",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::Direct => "direct",
        }
    }

    /// Where the algorithm comes from, in a few words (the command line's help).
    pub fn about(self) -> &'static str {
        match self {
            Algorithm::Ring => "reduce-scatter then all-gather around the ring (NCCL, Horovod)",
            Algorithm::Halving => "recursive halving then doubling (Rabenseifner, MPICH)",
            Algorithm::Hierarchical => "ring within a domain, ring across domains (NCCL across NVLink domains)",
            Algorithm::Direct => "every chunk straight to its owner, then an all-gather",
        }
    }
}

/// One way to reduce: the algorithm, what travels and what adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReducePlan {
    /// How partial sums travel.
    pub algorithm: Algorithm,
    /// The precision of every value sent (and of the inputs and the result).
    pub wire: Precision,
    /// The precision every addition is rounded to.
    pub accumulate: Precision,
    /// Ranks per domain for [`Algorithm::Hierarchical`] (must divide the world size); ignored
    /// otherwise.
    pub domain: usize,
}

impl ReducePlan {
    /// Checks the plan against a world of `ranks` ranks.
    pub fn check(&self, ranks: usize) -> Result<()> {
        moe_audit_core::error::ensure_positive(&[(crate::settings::RANKS, ranks)])?;
        if self.algorithm == Algorithm::Hierarchical && (self.domain == 0 || !ranks.is_multiple_of(self.domain)) {
            return Err(Error::usage(format!(
                "domain size {} does not divide {ranks} ranks (hierarchical reduction)",
                self.domain
            )));
        }
        Ok(())
    }
}

/// The element range of chunk `i` of `len` elements split into `parts` (sizes differ by at most 1).
pub fn chunk(len: usize, parts: usize, i: usize) -> Range<usize> {
    let at = |j: usize| (j as u128 * len as u128 / parts as u128) as usize;
    at(i)..at(i + 1)
}

/// Chunk `i` (modulo the group's size) of `seg` split over `group`'s members.
fn ring_chunk(seg: &Range<usize>, group: &Group, i: isize) -> Range<usize> {
    let g = group.len() as isize;
    let c = chunk(seg.len(), g as usize, i.rem_euclid(g) as usize);
    seg.start + c.start..seg.start + c.end
}

/// What one rank did in a reduction: bytes it sent, and what it holds.
#[derive(Debug, Clone)]
pub struct Reduced {
    /// The result (wire precision): the whole buffer after an all-reduce or all-gather, this
    /// rank's share after a reduce-scatter.
    pub values: Vec<f32>,
    /// The elements `values` covers (the whole buffer, or this rank's share).
    pub range: Range<usize>,
    /// Bytes this rank sent.
    pub bytes_sent: u64,
}

/// A set of ranks taking part in a step (a domain, or one rank per domain), and this rank's
/// index in it.
struct Group {
    members: Vec<usize>,
    me: usize,
}

impl Group {
    fn len(&self) -> usize {
        self.members.len()
    }
    /// The member `offset` places after this rank (modulo the group).
    fn at(&self, offset: isize) -> usize {
        let g = self.len() as isize;
        self.members[((self.me as isize + offset).rem_euclid(g)) as usize]
    }
}

/// One rank's side of a reduction: its communicator, its plan and what it sent.
struct Rank<'a> {
    comm: &'a dyn Communicator,
    plan: ReducePlan,
    sent: Cell<u64>,
}

impl Rank<'_> {
    /// Sends `values` (rounded to the wire) to `to`, returns the `len` values `from` sent.
    fn swap(&self, values: &[f32], to: usize, from: usize, len: usize) -> Result<Vec<f32>> {
        let wire = self.plan.wire;
        let bytes = wire.encode(values);
        self.sent.set(self.sent.get() + bytes.len() as u64);
        let got = self.comm.send_recv(&bytes, to, from, len * wire.bytes())?;
        Ok(wire.decode(&got))
    }

    /// `acc[i] += got[i]`, each addition rounded to the accumulator.
    fn add(&self, acc: &mut [f32], got: &[f32]) {
        let p = self.plan.accumulate;
        if p == Precision::F32 {
            // Rounding to f32 is the identity: a plain loop the compiler vectorises.
            acc.iter_mut().zip(got).for_each(|(a, &g)| *a += g);
            return;
        }
        for (a, &g) in acc.iter_mut().zip(got) {
            *a = p.round(*a + p.round(g));
        }
    }

    /// Ring reduce-scatter of `buf[seg]` over `group`: member i ends with chunk i summed (in the
    /// accumulator); chunk c is summed in the order c+1, c+2, …, c.
    fn ring_reduce_scatter(&self, group: &Group, buf: &mut [f32], seg: Range<usize>) -> Result<Range<usize>> {
        self.ring(group, buf, seg.clone(), 1, |acc, got| self.add(acc, got))?;
        Ok(ring_chunk(&seg, group, group.me as isize))
    }

    /// Ring all-gather of `buf[seg]` over `group`: member i holds chunk i; every member ends with all.
    fn ring_all_gather(&self, group: &Group, buf: &mut [f32], seg: Range<usize>) -> Result<()> {
        self.ring(group, buf, seg, 0, |dst, got| dst.copy_from_slice(got))
    }

    /// The ring loop both ring phases share: g − 1 steps; at step s a member sends its chunk
    /// `me − s − lag` to the next member and folds (`take`) the chunk `me − s − lag − 1` the
    /// previous member sent.
    fn ring(
        &self,
        group: &Group,
        buf: &mut [f32],
        seg: Range<usize>,
        lag: isize,
        take: impl Fn(&mut [f32], &[f32]),
    ) -> Result<()> {
        let me = group.me as isize;
        for s in 0..group.len() as isize - 1 {
            let (out, inc) = (ring_chunk(&seg, group, me - s - lag), ring_chunk(&seg, group, me - s - lag - 1));
            let got = self.swap(&buf[out], group.at(1), group.at(-1), inc.len())?;
            take(&mut buf[inc], &got);
        }
        Ok(())
    }

    /// Rounds `buf[range]` (a finished sum in the accumulator) to the wire.
    fn to_wire(&self, buf: &mut [f32], range: Range<usize>) {
        self.plan.wire.round_all(&mut buf[range]);
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<()> {
        let (rank, size, n) = (self.comm.rank(), self.comm.size(), buf.len());
        let world = Group { members: (0..size).collect(), me: rank };
        match self.plan.algorithm {
            Algorithm::Ring => {
                let mine = self.ring_reduce_scatter(&world, buf, 0..n)?;
                self.to_wire(buf, mine);
                self.ring_all_gather(&world, buf, 0..n)
            }
            Algorithm::Halving => self.halving(buf, true).map(|_| ()),
            Algorithm::Hierarchical => {
                let d = self.plan.domain;
                let (domain, local) = (rank / d, rank % d);
                let within = Group { members: (domain * d..domain * d + d).collect(), me: local };
                let across = Group { members: (0..size / d).map(|k| k * d + local).collect(), me: domain };
                let shard = self.ring_reduce_scatter(&within, buf, 0..n)?;
                let mine = self.ring_reduce_scatter(&across, buf, shard.clone())?;
                self.to_wire(buf, mine);
                self.ring_all_gather(&across, buf, shard)?;
                self.ring_all_gather(&within, buf, 0..n)
            }
            Algorithm::Direct => {
                let mine = self.direct_reduce_scatter(buf)?;
                self.to_wire(buf, mine);
                self.ring_all_gather(&world, buf, 0..n)
            }
        }
    }

    /// Every rank sends chunk j to rank j; the owner sums the contributions in rank order.
    fn direct_reduce_scatter(&self, buf: &mut [f32]) -> Result<Range<usize>> {
        let (rank, size, n) = (self.comm.rank(), self.comm.size(), buf.len());
        let mine = chunk(n, size, rank);
        let mut from: Vec<Option<Vec<f32>>> = vec![None; size];
        for s in 1..size {
            let (to, src) = ((rank + s) % size, (rank + size - s) % size);
            from[src] = Some(self.swap(&buf[chunk(n, size, to)], to, src, mine.len())?);
        }
        let own = buf[mine.clone()].to_vec();
        from[rank] = Some(own);
        let mut acc = vec![0.0f32; mine.len()];
        for got in from.iter().flatten() {
            self.add(&mut acc, got);
        }
        buf[mine.clone()].copy_from_slice(&acc);
        Ok(mine)
    }

    /// Recursive halving (and doubling when `gather`). Returns this rank's share after the
    /// halving (empty for a rank folded into its partner).
    fn halving(&self, buf: &mut [f32], gather: bool) -> Result<Range<usize>> {
        let (rank, size, n) = (self.comm.rank(), self.comm.size(), buf.len());
        let p = 1usize << (usize::BITS - 1 - size.leading_zeros());
        let rem = size - p;
        // Fold: of the first 2·rem ranks, each even one hands its buffer to the odd one after it.
        let virtual_rank = if rank < 2 * rem {
            if rank % 2 == 0 {
                self.swap(buf, rank + 1, rank + 1, 0)?;
                if gather {
                    let got = self.swap(&[], rank + 1, rank + 1, n)?;
                    buf.copy_from_slice(&got);
                }
                return Ok(0..0);
            }
            let got = self.swap(&[], rank - 1, rank - 1, n)?;
            self.add(buf, &got);
            rank / 2
        } else {
            rank - rem
        };
        let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
        let span = |lo: usize, hi: usize| chunk(n, p, lo).start..chunk(n, p, hi - 1).end;
        let (mut lo, mut hi) = (0, p);
        let mut mask = p / 2;
        while mask > 0 {
            let partner = real(virtual_rank ^ mask);
            let mid = lo + (hi - lo) / 2;
            let (keep, give) = if virtual_rank & mask == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
            let (keep_r, give_r) = (span(keep.0, keep.1), span(give.0, give.1));
            let got = self.swap(&buf[give_r], partner, partner, keep_r.len())?;
            self.add(&mut buf[keep_r], &got);
            (lo, hi) = keep;
            mask /= 2;
        }
        let mine = span(lo, hi);
        self.to_wire(buf, mine.clone());
        if !gather {
            return Ok(mine);
        }
        let mut mask = 1;
        while mask < p {
            let partner = real(virtual_rank ^ mask);
            // The partner holds the block of the same size beside ours.
            let block = hi - lo;
            let (plo, phi) = if virtual_rank & mask == 0 { (hi, hi + block) } else { (lo - block, lo) };
            let theirs = span(plo, phi);
            let got = self.swap(&buf[span(lo, hi)], partner, partner, theirs.len())?;
            buf[theirs].copy_from_slice(&got);
            (lo, hi) = (lo.min(plo), hi.max(phi));
            mask *= 2;
        }
        if rank < 2 * rem {
            // An odd rank of the fold returns the result to its even partner.
            self.swap(buf, rank - 1, rank - 1, 0)?;
        }
        Ok(mine)
    }
}

/// All-reduce (sum) of `input` over every rank of `comm` with `plan`: every rank gets the sum.
/// `input` is rounded to the wire precision first (the buffer handed to the collective); every
/// rank must pass the same length.
pub fn all_reduce(comm: &dyn Communicator, input: &[f32], plan: ReducePlan) -> Result<Reduced> {
    plan.check(comm.size())?;
    let rank = Rank { comm, plan, sent: Cell::new(0) };
    let mut buf = input.to_vec();
    plan.wire.round_all(&mut buf);
    rank.all_reduce(&mut buf)?;
    let range = 0..buf.len();
    Ok(Reduced { values: buf, range, bytes_sent: rank.sent.get() })
}

/// Reduce-scatter (sum) of `input`: every rank gets the sum of its share of the elements
/// ([`Reduced::range`]). Ring and direct give rank r [`chunk`]`(n, R, r)`; hierarchical gives
/// rank (domain D, local l) chunk D of chunk l of its domain's split; halving gives virtual rank v
/// chunk v of P (the largest power of two ≤ R), and ranks folded into a partner get nothing.
pub fn reduce_scatter(comm: &dyn Communicator, input: &[f32], plan: ReducePlan) -> Result<Reduced> {
    plan.check(comm.size())?;
    let (rank_id, size, n) = (comm.rank(), comm.size(), input.len());
    let rank = Rank { comm, plan, sent: Cell::new(0) };
    let mut buf = input.to_vec();
    plan.wire.round_all(&mut buf);
    let world = Group { members: (0..size).collect(), me: rank_id };
    let mine = match plan.algorithm {
        Algorithm::Ring => rank.ring_reduce_scatter(&world, &mut buf, 0..n)?,
        Algorithm::Direct => rank.direct_reduce_scatter(&mut buf)?,
        Algorithm::Halving => rank.halving(&mut buf, false)?,
        Algorithm::Hierarchical => {
            let d = plan.domain;
            let (domain, local) = (rank_id / d, rank_id % d);
            let within = Group { members: (domain * d..domain * d + d).collect(), me: local };
            let across = Group { members: (0..size / d).map(|k| k * d + local).collect(), me: domain };
            let shard = rank.ring_reduce_scatter(&within, &mut buf, 0..n)?;
            rank.ring_reduce_scatter(&across, &mut buf, shard)?
        }
    };
    rank.to_wire(&mut buf, mine.clone());
    Ok(Reduced { values: buf[mine.clone()].to_vec(), range: mine, bytes_sent: rank.sent.get() })
}

/// Ring all-gather: rank r contributes `share` as chunk [`chunk`]`(len, R, r)` of a buffer of
/// `len` elements; every rank gets the whole buffer (wire precision).
pub fn all_gather(comm: &dyn Communicator, share: &[f32], len: usize, wire: Precision) -> Result<Reduced> {
    let (rank_id, size) = (comm.rank(), comm.size());
    let mine = chunk(len, size, rank_id);
    if share.len() != mine.len() {
        return Err(Error::shape(
            "all-gather",
            format!("rank {rank_id} holds {} values, its chunk of {len} has {}", share.len(), mine.len()),
        ));
    }
    let plan = ReducePlan { algorithm: Algorithm::Ring, wire, accumulate: wire, domain: 1 };
    let rank = Rank { comm, plan, sent: Cell::new(0) };
    let mut buf = vec![0.0f32; len];
    buf[mine].iter_mut().zip(share).for_each(|(b, &s)| *b = wire.round(s));
    rank.ring_all_gather(&Group { members: (0..size).collect(), me: rank_id }, &mut buf, 0..len)?;
    Ok(Reduced { values: buf, range: 0..len, bytes_sent: rank.sent.get() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_ranks;

    fn plan(algorithm: Algorithm, wire: Precision, accumulate: Precision) -> ReducePlan {
        ReducePlan { algorithm, wire, accumulate, domain: 2 }
    }

    #[test]
    fn chunks_tile_the_buffer() {
        for (len, parts) in [(10, 3), (3, 5), (0, 4), (17, 17)] {
            let all: Vec<usize> = (0..parts).flat_map(|i| chunk(len, parts, i)).collect();
            assert_eq!(all, (0..len).collect::<Vec<_>>());
        }
    }

    #[test]
    fn every_algorithm_sums_small_integers_exactly_on_any_rank_count() {
        for ranks in [1, 2, 3, 4, 5, 6, 7, 8] {
            for algorithm in Algorithm::ALL {
                if algorithm == Algorithm::Hierarchical && ranks % 2 != 0 {
                    continue;
                }
                let n = 11;
                let out = run_ranks(ranks, |c| {
                    let x: Vec<f32> = (0..n).map(|i| (c.rank() * 3 + i) as f32).collect();
                    all_reduce(c, &x, plan(algorithm, Precision::F16, Precision::F16))
                })
                .unwrap();
                let want: Vec<f32> = (0..n).map(|i| (0..ranks).map(|r| (r * 3 + i) as f32).sum()).collect();
                for o in &out {
                    assert_eq!(o.values, want, "{algorithm:?} on {ranks} ranks");
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_and_all_gather_invert() {
        let out = run_ranks(4, |c| {
            let x: Vec<f32> = (0..10).map(|i| (i * (c.rank() + 1)) as f32).collect();
            let rs = reduce_scatter(c, &x, plan(Algorithm::Ring, Precision::F32, Precision::F32))?;
            assert_eq!(rs.range, chunk(10, 4, c.rank()));
            all_gather(c, &rs.values, 10, Precision::F32)
        })
        .unwrap();
        let want: Vec<f32> = (0..10).map(|i| (i * 10) as f32).collect();
        assert!(out.iter().all(|o| o.values == want));
    }

    #[test]
    fn ring_traffic_is_the_standard_formula() {
        let out =
            run_ranks(4, |c| all_reduce(c, &[1.0; 16], plan(Algorithm::Ring, Precision::F16, Precision::F32))).unwrap();
        // 2·B·(R−1)/R with B = 16 values × 2 bytes.
        assert!(out.iter().all(|o| o.bytes_sent == 2 * 32 * 3 / 4));
    }
}
