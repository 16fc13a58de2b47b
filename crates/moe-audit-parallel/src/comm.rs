//! The communicator: the few collectives expert parallelism needs, and in-process ranks.
//!
//! In-process ranks are threads sharing one mailbox: the default backend, and the oracle the
//! MPI backend is tested against. A failing rank poisons the mailbox, so every other rank's
//! next (or pending) collective returns the same error instead of waiting for it forever.

use moe_audit_core::error::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Rank, world size and the collectives of an expert-parallel exchange. Every rank must call
/// the same collectives in the same order.
pub trait Communicator {
    /// This rank, `0..size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Fixed-count all-to-all of counts: `send` holds `per_rank` counts for each destination in
    /// rank order; returns `per_rank` counts from each source in rank order.
    fn all_to_all_counts(&self, send: &[usize], per_rank: usize) -> Result<Vec<usize>> {
        check_counts("count exchange", send, per_rank, self.size())?;
        self.exchange_counts(send, per_rank)
    }
    /// Variable-count all-to-all of rows of `width` values: `send` holds the rows for rank 0,
    /// then rank 1, ...; `send_rows[d]` rows go to rank d and `recv_rows[s]` rows come from rank
    /// s (known from a count exchange). Returns the received rows, source rank order.
    fn all_to_all_rows(
        &self,
        send: Vec<f32>,
        width: usize,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Vec<f32>> {
        check_counts("all-to-all send counts", send_rows, 1, self.size())?;
        check_counts("all-to-all receive counts", recv_rows, 1, self.size())?;
        check_rows("all-to-all send buffer", send_rows, width, send.len())?;
        self.exchange_rows(send, width, send_rows, recv_rows)
    }
    /// [`Communicator::all_to_all_counts`] on arguments already checked (one count slice per
    /// rank: rsmpi, for one, reads past the end of a short one).
    fn exchange_counts(&self, send: &[usize], per_rank: usize) -> Result<Vec<usize>>;
    /// [`Communicator::all_to_all_rows`] on arguments already checked.
    fn exchange_rows(&self, send: Vec<f32>, width: usize, send_rows: &[usize], recv_rows: &[usize])
        -> Result<Vec<f32>>;
    /// Every rank's bytes, on every rank, in rank order.
    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>>;
    /// Waits until every rank gets here.
    fn barrier(&self) -> Result<()>;
    /// Sends `send` to rank `to` and receives `recv_len` bytes from rank `from` in one step (MPI
    /// `Sendrecv`): the point-to-point exchange the reductions are built of. Every rank of the
    /// step calls it, so that each message sent is received.
    fn send_recv(&self, send: &[u8], to: usize, from: usize, recv_len: usize) -> Result<Vec<u8>> {
        let size = self.size();
        if to >= size || from >= size {
            return Err(Error::shape("send-receive", format!("ranks {to} and {from} asked for, {size} ranks")));
        }
        self.exchange_pair(send, to, from, recv_len)
    }
    /// [`Communicator::send_recv`] on ranks already checked.
    fn exchange_pair(&self, send: &[u8], to: usize, from: usize, recv_len: usize) -> Result<Vec<u8>>;

    /// Variable-count all-to-all with the count exchange inside: returns the rows received
    /// (source rank order) and how many came from each rank.
    fn all_to_all_v(&self, send: Vec<f32>, width: usize, send_rows: &[usize]) -> Result<(Vec<f32>, Vec<usize>)> {
        let recv_rows = self.all_to_all_counts(send_rows, 1)?;
        let rows = self.all_to_all_rows(send, width, send_rows, &recv_rows)?;
        Ok((rows, recv_rows))
    }
}

/// Checks a per-destination count slice (rsmpi does not: a short slice reads past its end).
fn check_counts(context: &str, counts: &[usize], per_rank: usize, size: usize) -> Result<()> {
    if counts.len() != per_rank * size {
        return Err(Error::shape(
            context,
            format!("{} counts for {size} ranks × {per_rank}, expected {}", counts.len(), per_rank * size),
        ));
    }
    Ok(())
}

/// Checks that `rows` rows of `width` values fill `len` values.
fn check_rows(context: &str, rows: &[usize], width: usize, len: usize) -> Result<()> {
    let total: usize = rows.iter().sum();
    if total * width != len {
        return Err(Error::shape(
            context,
            format!("{total} rows of {width} values, but the buffer holds {len} values"),
        ));
    }
    Ok(())
}

/// What one rank left for another in the current collective.
enum Message {
    Counts(Vec<usize>),
    /// A segment `[start, start + len)` of the sender's buffer (shared: the receiver copies it).
    Rows(Arc<Vec<f32>>, usize, usize),
    Bytes(Arc<Vec<u8>>),
    /// A point-to-point message (one sender, one receiver).
    Point(Vec<u8>),
    Barrier,
}

struct State {
    /// `mail[dst][src]`: what `src` sent `dst` in the collective `dst` has not yet collected.
    mail: Vec<Vec<Option<Message>>>,
    /// The first failure: (rank, message).
    failure: Option<(usize, String)>,
    /// Ranks whose work returned: a collective waiting for one of them fails instead of hanging.
    finished: Vec<bool>,
}

/// The mailbox the in-process ranks share.
struct Shared {
    size: usize,
    state: Mutex<State>,
    wake: Condvar,
    /// One per rank, for send-receive: a point-to-point step wakes only the two ranks it
    /// concerns (a ring step waking every rank costs R² wake-ups).
    inbox: Vec<Condvar>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panics is caught before it can poison the lock while holding it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a rank's own failure. Of ranks failing alike (bad input every rank sees), the
    /// lowest is kept, so the error reported does not depend on thread timing.
    fn fail(&self, rank: usize, message: String) {
        let mut state = self.lock();
        if state.failure.as_ref().is_none_or(|(r, _)| rank < *r) {
            state.failure = Some((rank, message));
        }
        self.wake_everyone();
    }

    /// Wakes every waiting rank, in a collective or a send-receive.
    fn wake_everyone(&self) {
        self.wake.notify_all();
        self.inbox.iter().for_each(Condvar::notify_all);
    }
}

fn failed(failure: &(usize, String)) -> Error {
    Error::Rank { rank: failure.0, message: failure.1.clone() }
}

/// One in-process rank (a thread); see [`run_ranks`].
pub struct InProcess {
    rank: usize,
    shared: Arc<Shared>,
}

impl InProcess {
    /// Sends `make(dst)` to every rank, then collects one message from every rank.
    fn exchange(&self, make: impl Fn(usize) -> Message) -> Result<Vec<Message>> {
        let shared = &self.shared;
        let mut state = shared.lock();
        for dst in 0..shared.size {
            // The destination may not have collected our previous message yet.
            while state.mail[dst][self.rank].is_some() {
                if let Some(f) = &state.failure {
                    return Err(failed(f));
                }
                if state.finished[dst] {
                    return Err(gone(dst));
                }
                state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            state.mail[dst][self.rank] = Some(make(dst));
        }
        shared.wake_everyone();
        loop {
            if let Some(f) = &state.failure {
                return Err(failed(f));
            }
            if let Some(src) = (0..shared.size).find(|&src| state.mail[self.rank][src].is_none() && state.finished[src])
            {
                return Err(gone(src));
            }
            if state.mail[self.rank].iter().all(Option::is_some) {
                let got = state.mail[self.rank].iter_mut().map(|m| m.take().expect("all present")).collect();
                shared.wake_everyone();
                return Ok(got);
            }
            state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl InProcess {
    /// Posts `message` for `to`, then waits for the one `from` posted for this rank.
    fn pair(&self, message: Message, to: usize, from: usize) -> Result<Message> {
        let shared = &self.shared;
        let mut state = shared.lock();
        // `to` may not have collected our previous message yet.
        while state.mail[to][self.rank].is_some() {
            if let Some(f) = &state.failure {
                return Err(failed(f));
            }
            if state.finished[to] {
                return Err(gone(to));
            }
            state = shared.inbox[self.rank].wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.mail[to][self.rank] = Some(message);
        // `to` may wait in a send-receive, or (ranks out of step) in a collective.
        shared.inbox[to].notify_all();
        shared.wake.notify_all();
        loop {
            if let Some(f) = &state.failure {
                return Err(failed(f));
            }
            if let Some(m) = state.mail[self.rank][from].take() {
                // `from` may wait for this slot to post its next message.
                shared.inbox[from].notify_all();
                shared.wake.notify_all();
                return Ok(m);
            }
            if state.finished[from] {
                return Err(gone(from));
            }
            state = shared.inbox[self.rank].wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn gone(rank: usize) -> Error {
    Error::shape(
        "in-process all-to-all",
        format!("rank {rank} returned while another rank waits for it in a collective"),
    )
}

fn mismatch(what: &str) -> Error {
    Error::shape("in-process all-to-all", format!("ranks called different collectives (expected {what})"))
}

impl Communicator for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn exchange_counts(&self, send: &[usize], per_rank: usize) -> Result<Vec<usize>> {
        let got = self.exchange(|dst| Message::Counts(send[dst * per_rank..(dst + 1) * per_rank].to_vec()))?;
        let mut out = Vec::with_capacity(send.len());
        for m in got {
            match m {
                Message::Counts(c) if c.len() == per_rank => out.extend(c),
                Message::Counts(c) => {
                    return Err(Error::shape(
                        "count exchange",
                        format!("a rank sent {} counts, expected {per_rank}", c.len()),
                    ))
                }
                _ => return Err(mismatch("a count exchange")),
            }
        }
        Ok(out)
    }

    fn exchange_rows(
        &self,
        send: Vec<f32>,
        width: usize,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Vec<f32>> {
        let starts: Vec<usize> =
            send_rows.iter().scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n * width))).collect();
        let send = Arc::new(send);
        let got = self.exchange(|dst| Message::Rows(Arc::clone(&send), starts[dst], send_rows[dst] * width))?;
        drop(send);
        let mut out = Vec::with_capacity(recv_rows.iter().sum::<usize>() * width);
        for (src, m) in got.into_iter().enumerate() {
            let Message::Rows(data, start, len) = m else { return Err(mismatch("a row all-to-all")) };
            if len != recv_rows[src] * width {
                return Err(Error::shape(
                    "all-to-all",
                    format!("rank {src} sent {} rows, {} expected", len / width.max(1), recv_rows[src]),
                ));
            }
            out.extend_from_slice(&data[start..start + len]);
        }
        Ok(out)
    }

    fn all_gather_bytes(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let bytes = Arc::new(bytes);
        let got = self.exchange(|_| Message::Bytes(Arc::clone(&bytes)))?;
        got.into_iter()
            .map(|m| if let Message::Bytes(b) = m { Ok(b.to_vec()) } else { Err(mismatch("an all-gather")) })
            .collect()
    }

    fn exchange_pair(&self, send: &[u8], to: usize, from: usize, recv_len: usize) -> Result<Vec<u8>> {
        match self.pair(Message::Point(send.to_vec()), to, from)? {
            Message::Point(got) if got.len() == recv_len => Ok(got),
            Message::Point(got) => {
                Err(Error::shape("send-receive", format!("rank {from} sent {} bytes, {recv_len} expected", got.len())))
            }
            _ => Err(mismatch("a send-receive")),
        }
    }

    fn barrier(&self) -> Result<()> {
        for m in self.exchange(|_| Message::Barrier)? {
            if !matches!(m, Message::Barrier) {
                return Err(mismatch("a barrier"));
            }
        }
        Ok(())
    }
}

/// Runs `work` on `size` in-process ranks (one thread each) and returns each rank's result in
/// rank order. If a rank fails (an error or a panic), every rank stops at its next collective
/// and the call returns that first failure as [`Error::Rank`].
pub fn run_ranks<T: Send>(size: usize, work: impl Fn(&InProcess) -> Result<T> + Sync) -> Result<Vec<T>> {
    moe_audit_core::error::ensure_positive(&[(crate::settings::RANKS, size)])?;
    let shared = Arc::new(Shared {
        size,
        state: Mutex::new(State {
            mail: (0..size).map(|_| (0..size).map(|_| None).collect()).collect(),
            failure: None,
            finished: vec![false; size],
        }),
        wake: Condvar::new(),
        inbox: (0..size).map(|_| Condvar::new()).collect(),
    });
    let results: Vec<Option<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let comm = InProcess { rank, shared: Arc::clone(&shared) };
                let work = &work;
                scope.spawn(move || match catch_unwind(AssertUnwindSafe(|| work(&comm))) {
                    Ok(Ok(value)) => {
                        let mut state = comm.shared.lock();
                        state.finished[rank] = true;
                        comm.shared.wake_everyone();
                        Some(value)
                    }
                    // A peer's failure, already recorded.
                    Ok(Err(Error::Rank { .. })) => None,
                    Ok(Err(e)) => {
                        comm.shared.fail(rank, moe_audit_core::error::chain(&e));
                        None
                    }
                    Err(_) => {
                        comm.shared.fail(rank, "panicked".into());
                        None
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().ok().flatten()).collect()
    });
    if let Some(f) = &shared.lock().failure {
        return Err(failed(f));
    }
    Ok(results.into_iter().map(|r| r.expect("no failure recorded, so every rank returned")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_reach_their_rank_in_source_order() {
        // Rank r sends (r + d + 1) rows of value 10r + d to rank d, rows of width 2.
        let out = run_ranks(3, |c| {
            let r = c.rank();
            let counts: Vec<usize> = (0..3).map(|d| r + d + 1).collect();
            let send: Vec<f32> = (0..3).flat_map(|d| vec![(10 * r + d) as f32; 2 * (r + d + 1)]).collect();
            c.all_to_all_v(send, 2, &counts)
        })
        .unwrap();
        for (d, (rows, from)) in out.iter().enumerate() {
            assert_eq!(*from, (0..3).map(|s| s + d + 1).collect::<Vec<_>>());
            let want: Vec<f32> = (0..3).flat_map(|s| vec![(10 * s + d) as f32; 2 * (s + d + 1)]).collect();
            assert_eq!(rows, &want);
        }
    }

    #[test]
    fn a_failing_rank_stops_every_rank_with_its_error() {
        let err = run_ranks(4, |c| {
            for _ in 0..3 {
                c.barrier()?;
            }
            if c.rank() == 2 {
                return Err(Error::usage("bad shape"));
            }
            c.barrier()?;
            c.all_gather_bytes(vec![1])
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "rank 2 failed: bad shape");
        let err = run_ranks(2, |c| if c.rank() == 1 { panic!("boom") } else { c.barrier() }).unwrap_err();
        assert_eq!(err.to_string(), "rank 1 failed: panicked");
    }

    #[test]
    fn ranks_failing_alike_report_the_lowest() {
        for _ in 0..20 {
            let err = run_ranks(4, |c| {
                if c.rank() >= 1 {
                    Err::<(), _>(Error::usage(format!("bad {}", c.rank())))
                } else {
                    c.barrier()
                }
            })
            .unwrap_err();
            assert_eq!(err.to_string(), "rank 1 failed: bad 1");
        }
    }

    #[test]
    fn a_rank_that_returns_early_does_not_hang_the_others() {
        let err = run_ranks(3, |c| if c.rank() == 1 { Ok(()) } else { c.barrier() }).unwrap_err();
        assert!(err.to_string().ends_with("rank 1 returned while another rank waits for it in a collective"), "{err}");
    }

    #[test]
    fn wrong_count_slices_are_errors() {
        let err = run_ranks(2, |c| c.all_to_all_rows(vec![0.0; 4], 2, &[1, 1, 0], &[1, 1])).unwrap_err();
        assert!(err.to_string().contains("3 counts for 2 ranks"), "{err}");
    }
}
