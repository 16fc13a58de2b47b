//! MPI ranks through rsmpi (`mpi` 0.8): one rank per process, launched by `mpirun`.
//!
//! MPI is initialised once per process ([`MpiComm::init`]); rsmpi does not check that a counts
//! slice has one entry per rank (a short one reads past its end): the trait's collectives check
//! their arguments before they get here.

use super::comm::Communicator;
use moe_audit_core::error::{Error, Result};
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives as _, Equivalence as _};
use mpi::Count;

/// The MPI world as a [`Communicator`]. Dropping it finalises MPI.
pub struct MpiComm {
    world: SimpleCommunicator,
    _universe: mpi::environment::Universe,
}

impl MpiComm {
    /// Initialises MPI (once per process).
    pub fn init() -> Result<Self> {
        let universe = mpi::initialize().ok_or_else(|| Error::usage("MPI is already initialised in this process"))?;
        Ok(MpiComm { world: universe.world(), _universe: universe })
    }

    /// Prints `error` and aborts every rank with exit code 2 (MPI_Abort): no rank waits forever
    /// for a peer that failed.
    pub fn abort(&self, error: &Error) -> ! {
        eprintln!("error: rank {} failed: {error}", self.rank());
        self.world.abort(2)
    }
}

fn counts(context: &str, n: &[usize], scale: usize) -> Result<(Vec<Count>, Vec<Count>)> {
    let too_big = || Error::shape(context, format!("more than {} values to move", Count::MAX));
    let counts = n.iter().map(|&c| Count::try_from(c * scale).map_err(|_| too_big())).collect::<Result<Vec<_>>>()?;
    let displs = counts.iter().scan(0 as Count, |acc, &c| {
        let d = *acc;
        *acc = acc.saturating_add(c);
        Some(d)
    });
    let displs: Vec<Count> = displs.collect();
    if counts.iter().map(|&c| i64::from(c)).sum::<i64>() > i64::from(Count::MAX) {
        return Err(too_big());
    }
    Ok((counts, displs))
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn size(&self) -> usize {
        self.world.size() as usize
    }

    fn exchange_counts(&self, send: &[usize], _per_rank: usize) -> Result<Vec<usize>> {
        let send: Vec<u64> = send.iter().map(|&c| c as u64).collect();
        let mut recv = vec![0u64; send.len()];
        self.world.all_to_all_into(&send[..], &mut recv[..]);
        Ok(recv.into_iter().map(|c| c as usize).collect())
    }

    fn exchange_rows(
        &self,
        send: Vec<f32>,
        width: usize,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Vec<f32>> {
        let (sc, sd) = counts("all-to-all", send_rows, width)?;
        let (rc, rd) = counts("all-to-all", recv_rows, width)?;
        let mut recv = vec![0f32; recv_rows.iter().sum::<usize>() * width];
        let send_part = Partition::new(&send[..], sc, sd);
        let mut recv_part = PartitionMut::new(&mut recv[..], rc, rd);
        self.world.all_to_all_varcount_into(&send_part, &mut recv_part);
        Ok(recv)
    }

    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let len = bytes.len() as u64;
        let mut lens = vec![0u64; self.size()];
        self.world.all_gather_into(&len, &mut lens[..]);
        let lens: Vec<usize> = lens.into_iter().map(|l| l as usize).collect();
        let (rc, rd) = counts("all-gather", &lens, 1)?;
        let mut recv = vec![0u8; lens.iter().sum()];
        self.world.all_gather_varcount_into(&bytes[..], &mut PartitionMut::new(&mut recv[..], rc, rd));
        let mut out = Vec::with_capacity(lens.len());
        let mut at = 0;
        for l in lens {
            out.push(recv[at..at + l].to_vec());
            at += l;
        }
        Ok(out)
    }

    fn exchange_pair(&self, send: &[u8], to: usize, from: usize, recv_len: usize) -> Result<Vec<u8>> {
        if Count::try_from(send.len().max(recv_len)).is_err() {
            return Err(Error::shape("send-receive", format!("more than {} bytes in one message", Count::MAX)));
        }
        let mut recv = vec![0u8; recv_len];
        let status = mpi::point_to_point::send_receive_into(
            send,
            &self.world.process_at_rank(to as mpi::Rank),
            &mut recv[..],
            &self.world.process_at_rank(from as mpi::Rank),
        );
        let got = status.count(u8::equivalent_datatype());
        if usize::try_from(got).ok() != Some(recv_len) {
            return Err(Error::shape("send-receive", format!("rank {from} sent {got} bytes, {recv_len} expected")));
        }
        Ok(recv)
    }

    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }
}
