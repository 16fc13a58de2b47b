//! A router in another process, spoken to over `moe-audit/1` (JSON lines) or `moe-audit/2`
//! (binary frames) on its stdin and stdout, whichever its handshake names.
//!
//! Nothing the router does can hang or bloat the audit. A writer thread feeds its stdin and a
//! reader thread reads its stdout on demand, a line or a payload at a time, each of bounded
//! length (the memory limit; a payload's length is checked before it is allocated), so every
//! write and every read waits at most `--timeout`; a router that hangs, crashes, stops reading,
//! never ends a line or answers garbage ends the audit with an error naming the request. Its
//! whole process tree is killed then, on drop, and on SIGINT/SIGTERM ([`kill_all`]): the process
//! group `sh -c` leads, every descendant found through `/proc`, and every process carrying the
//! router's environment tag (a grandchild that left with `setsid` and was orphaned keeps it).
//! Calls are serialised (one child, one conversation) and the router tells the analyzer not to
//! run them concurrently, so request ids and the order a stateful router sees are the same on
//! every run.

use super::protocol::{self, frame_request, parse_response, Asked, BinaryHeader, Handshake, InputKind, Request};
use super::{Answers, External};
use crate::mode::Mode;
use moe_audit_core::error::{excerpt_long, Error, Result};
use moe_audit_core::error::{ProtocolError, Text};
use moe_audit_core::routing::Routing;
use moe_audit_core::text;
use moe_audit_core::MemoryBudget;
use ndarray::{ArrayView2, ArrayView3};
use std::io::{BufReader, Read, Write};
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How much of the child's stderr is kept for error messages.
const STDERR_TAIL: usize = 2000;

/// The environment variable tagging a router's process tree.
const TAG_VAR: &str = "MOE_AUDIT_ROUTER_TAG";

/// The environment variable telling the router `--timeout` in whole seconds (a layer over ranks
/// waits for its other ranks less than that, and names the one that did not answer).
const TIMEOUT_VAR: &str = "MOE_AUDIT_TIMEOUT";

/// How a rank of a layer run expert-parallel names itself on stderr: its line is quoted rather
/// than the launcher's summary that follows it.
const RANK_LINE: &str = "moe-audit: rank ";

/// How long a router that exited may still deliver lines already in its pipe.
const EXIT_GRACE: Duration = Duration::from_millis(300);

/// The longest `--timeout` (a day): longer is a typo, and `Duration` has limits.
const MAX_TIMEOUT_SECS: f64 = 86_400.0;

/// The timeout in seconds as a duration: finite, positive, at most a day.
pub fn timeout(secs: f64) -> Result<Duration> {
    if !(secs.is_finite() && secs > 0.0 && secs <= MAX_TIMEOUT_SECS) {
        return Err(Error::usage(text!(
            crate::settings::TIMEOUT,
            format!(" must be a number of seconds in (0, {MAX_TIMEOUT_SECS}], got {secs:?}")
        )));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Routers alive in this process: (process group, tag), for [`kill_all`].
static LIVE: Mutex<Vec<(i32, String)>> = Mutex::new(Vec::new());

/// Kills every router tree this process started (a signal ends the run); how many there were.
pub fn kill_all() -> usize {
    let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    for (pid, tag) in live.iter() {
        kill_tree(*pid, tag);
    }
    live.len()
}

/// What the reader thread reads next from the router's stdout.
enum Want {
    /// A line (without its newline).
    Line,
    /// Exactly this many bytes (already checked against the memory limit).
    Bytes(usize),
}

/// What the reader thread read.
enum Got {
    Line(String),
    Bytes(Vec<u8>),
}

/// The live conversation.
struct Conversation {
    child: Child,
    /// Messages to write to the router's stdin; dropping it closes the pipe.
    requests: Option<SyncSender<Vec<u8>>>,
    /// The writer's result per message.
    written: Receiver<std::io::Result<()>>,
    /// What to read next; the reader reads nothing unasked (a payload is not a line).
    wants: mpsc::Sender<Want>,
    got: Receiver<std::io::Result<Got>>,
    next_id: u64,
    /// Set once an error stopped the child: later calls fail with it.
    failed: Option<Text>,
    /// The tree was killed and the child reaped (its pid may belong to another process now).
    stopped: bool,
}

/// A process spoken to over stdin and stdout, a line or a payload at a time, every wait
/// bounded (the conversation of every protocol version: `/1`, `/2` and the whole-model `/3`).
pub(crate) struct Peer {
    /// What the process is in messages: `router` or `model`.
    role: &'static str,
    command: String,
    timeout: Duration,
    /// The longest line or payload the process may send.
    read_limit: usize,
    tag: String,
    stderr: Arc<Mutex<Vec<u8>>>,
    /// Disconnects when the stderr reader has seen the end of the pipe.
    stderr_done: Mutex<Receiver<()>>,
    conversation: Mutex<Conversation>,
}

/// A router process and the conversation with it.
pub struct Subprocess {
    peer: Peer,
    /// The `seed` of every `/2` request: the audit's seed.
    seed: u64,
    handshake: Handshake,
}

/// A router behind a command (`--router-cmd "python3 my_router.py"`).
pub type ExternalRouter = External<Subprocess>;

impl ExternalRouter {
    /// Spawns `command` with `sh -c`, reads its handshake, and (for `input: hidden`) finds the
    /// targeted rows from a seeded pool (at most `budget` bytes, which also bounds a line or
    /// payload the router sends). `timeout` bounds the handshake and every write and read; the
    /// router is audited in `mode` (M compares it with the other one).
    pub fn spawn(command: &str, timeout: Duration, seed: u64, mode: Mode, budget: MemoryBudget) -> Result<Self> {
        let peer = Peer::spawn("router", command, timeout, budget)?;
        let handshake = peer.handshake(Handshake::validate)?;
        External::new(Subprocess { peer, seed, handshake }, seed, mode, true, budget)
    }

    /// Another launch of this router's layer (`check --layout-cmd`: the same layer at another
    /// expert-parallel size), spawned as this one was (`timeout`, `budget`, its seed and mode)
    /// and refused unless its handshake describes the same layer ([`Handshake::same_layer`]).
    /// The layout probe routes the base call through it: it needs no targeted rows.
    pub fn spawn_layout(&self, command: &str, timeout: Duration, budget: MemoryBudget) -> Result<Self> {
        let peer = Peer::spawn("layout launch", command, timeout, budget)?;
        let ours = self.handshake();
        let handshake = peer.handshake(|h: &Handshake| h.validate().and_then(|()| ours.same_layer(h)))?;
        let seed = self.source().seed;
        External::new(Subprocess { peer, seed, handshake }, seed, self.mode, false, budget)
    }
}

impl Peer {
    /// Spawns `command` with `sh -c` in its own process group, tagged, with the threads that
    /// write its stdin and read its stdout and stderr. A line or payload it sends may take at
    /// most a quarter of `budget` (at least 64 KiB); `timeout` bounds every write and read.
    /// `role` names it in messages (`router`, `model`).
    pub(crate) fn spawn(role: &'static str, command: &str, timeout: Duration, budget: MemoryBudget) -> Result<Self> {
        let tag = tag();
        let mut child = start(role, command, &tag, timeout)?;
        let read_limit = budget.message();
        let (wants, got) = read_stdout(child.stdout.take().expect("piped"), read_limit);
        let (requests, written) = write_stdin(child.stdin.take().expect("piped"));
        let (stderr, stderr_done) = keep_stderr_tail(child.stderr.take().expect("piped"));
        let conversation = Conversation {
            child,
            requests: Some(requests),
            written,
            wants,
            got,
            next_id: 1,
            failed: None,
            stopped: false,
        };
        Ok(Peer {
            role,
            command: command.to_string(),
            timeout,
            read_limit,
            tag,
            stderr,
            stderr_done: Mutex::new(stderr_done),
            conversation: Mutex::new(conversation),
        })
    }
}

/// `sh -c command` in its own process group (killing it also kills what `sh -c` started), with
/// piped stdio, registered as live under the lock, so a signal arriving now still finds it.
fn start(role: &str, command: &str, tag: &str, timeout: Duration) -> Result<Child> {
    let mut child = Command::new("sh");
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut child, 0);
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    let child = child
        .args(["-c", command])
        .env(TAG_VAR, tag)
        .env(TIMEOUT_VAR, timeout.as_secs().max(1).to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("{role} `{command}`"), "cannot start", e))?;
    live.push((child.id() as i32, tag.to_string()));
    Ok(child)
}

/// The stdout reader's thread: it reads what it is asked for (a line of at most `read_limit`
/// bytes, or a payload of a given size), nothing unasked, and stops at the end or an error.
fn read_stdout(stdout: ChildStdout, read_limit: usize) -> (mpsc::Sender<Want>, Receiver<std::io::Result<Got>>) {
    let (wants, want) = mpsc::channel::<Want>();
    let (tx, got) = mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        for want in want {
            let read = match want {
                Want::Line => {
                    moe_audit_core::files::read_line_bounded(&mut reader, read_limit).map(|l| l.map(Got::Line))
                }
                Want::Bytes(n) => read_payload(&mut reader, n).map(|b| Some(Got::Bytes(b))),
            };
            let Some(read) = read.transpose() else { break };
            let stop = read.is_err();
            if tx.send(read).is_err() || stop {
                break;
            }
        }
    });
    (wants, got)
}

/// The stdin writer's thread, one message in flight: calls wait for each write before the next.
fn write_stdin(mut stdin: ChildStdin) -> (SyncSender<Vec<u8>>, Receiver<std::io::Result<()>>) {
    let (requests, to_write) = mpsc::sync_channel::<Vec<u8>>(1);
    let (wrote, written) = mpsc::channel();
    std::thread::spawn(move || {
        for line in to_write {
            let result = stdin.write_all(&line).and_then(|()| stdin.flush());
            let stop = result.is_err();
            if wrote.send(result).is_err() || stop {
                break;
            }
        }
    });
    (requests, written)
}

/// The stderr reader's thread, keeping the last [`STDERR_TAIL`] bytes for messages; the
/// receiver disconnects when it has seen the end of the pipe.
fn keep_stderr_tail(mut err_pipe: ChildStderr) -> (Arc<Mutex<Vec<u8>>>, Receiver<()>) {
    let stderr = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&stderr);
    let (done, stderr_done) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let _done = done;
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = err_pipe.read(&mut buf) {
            let mut tail = sink.lock().unwrap_or_else(|e| e.into_inner());
            tail.extend_from_slice(&buf[..n]);
            let excess = tail.len().saturating_sub(STDERR_TAIL);
            tail.drain(..excess);
        }
    });
    (stderr, stderr_done)
}

/// A tag no other router (of this or another moe-audit) carries.
fn tag() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{}-{}-{nanos}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

impl Peer {
    pub(crate) fn error(&self, message: impl Into<Text>) -> Error {
        Error::input(format!("{} `{}`", self.role, self.command), message)
    }

    fn conversation(&self) -> std::sync::MutexGuard<'_, Conversation> {
        self.conversation.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Kills the router's tree and returns the error (with the tail of its stderr, if any).
    pub(crate) fn fail(&self, message: impl Into<Text>) -> Error {
        let message = message.into();
        let mut conv = self.conversation();
        stop(&mut conv, &self.tag);
        // The tree is dead: its stderr ends at once; read what it said last.
        let _ = self.stderr_done.lock().unwrap_or_else(|e| e.into_inner()).recv_timeout(Duration::from_secs(1));
        let tail = String::from_utf8_lossy(&self.stderr.lock().unwrap_or_else(|e| e.into_inner())).trim().to_string();
        let message = match last_words(&tail) {
            Some(last) if !last.is_empty() => message.then(format!("; its stderr ends: {}", excerpt_long(last))),
            _ => message,
        };
        conv.failed = Some(message.clone());
        self.error(message)
    }

    /// The next line; `what` is `its handshake` or `request N (...)`.
    pub(crate) fn receive_line(&self, what: &str) -> Result<String> {
        match self.receive(Want::Line, what)? {
            Got::Line(line) => Ok(line),
            Got::Bytes(_) => unreachable!("a line was asked"),
        }
    }

    /// The next `n` bytes (a `/2` payload, `n` checked against the memory limit).
    pub(crate) fn receive_bytes(&self, n: usize, what: &str) -> Result<Vec<u8>> {
        match self.receive(Want::Bytes(n), what)? {
            Got::Bytes(bytes) => Ok(bytes),
            Got::Line(_) => unreachable!("bytes were asked"),
        }
    }

    /// Reads what `want` says. Waits at most the timeout, and less when the router exits
    /// without answering (even if a background child of it still holds its stdout).
    fn receive(&self, want: Want, what: &str) -> Result<Got> {
        // A reader that stopped (end of output, an error) shows as a disconnection below.
        let _ = self.conversation().wants.send(want);
        let (waiting_for, before) = match what.starts_with("request") {
            true => (format!("the answer to {what}"), format!("answering {what}")),
            false => (what.to_string(), what.to_string()),
        };
        let deadline = Instant::now() + self.timeout;
        let mut exited: Option<(Instant, String)> = None;
        loop {
            let now = Instant::now();
            let slice = deadline.saturating_duration_since(now).min(Duration::from_millis(50));
            let got = self.conversation().got.recv_timeout(slice);
            match got {
                Ok(Ok(line)) => return Ok(line),
                Ok(Err(e)) => return Err(self.fail(format!("reading {waiting_for}: {e}"))),
                Err(RecvTimeoutError::Disconnected) => {
                    let status = {
                        let mut conv = self.conversation();
                        match exited.take() {
                            Some((_, status)) => status,
                            None => wait_briefly(&mut conv.child),
                        }
                    };
                    return Err(self.fail(format!("the {} exited ({status}) before {before}", self.role)));
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            let now = Instant::now();
            if let Some((at, status)) = &exited {
                if now >= *at + EXIT_GRACE {
                    return Err(self.fail(format!("the {} exited ({status}) before {before}", self.role)));
                }
            } else if let Ok(Some(status)) = self.conversation().child.try_wait() {
                exited = Some((now, status.to_string()));
            }
            if now >= deadline {
                return Err(self.fail(text!(
                    format!("timed out after {} s (", self.timeout.as_secs_f64()),
                    crate::settings::TIMEOUT,
                    format!(") waiting for {waiting_for}; the {} was killed", self.role)
                )));
            }
        }
    }

    /// Writes one line to the router within the timeout.
    pub(crate) fn send(&self, line: Vec<u8>, what: &str) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let result = {
            let conv = self.conversation();
            match &conv.requests {
                Some(requests) => match requests.try_send(line) {
                    Ok(()) => {
                        conv.written.recv_timeout(deadline.saturating_duration_since(Instant::now())).map_err(|e| {
                            match e {
                                RecvTimeoutError::Timeout => None,
                                RecvTimeoutError::Disconnected => Some("its stdin is closed".to_string()),
                            }
                        })
                    }
                    Err(mpsc::TrySendError::Full(_)) => Err(None),
                    Err(mpsc::TrySendError::Disconnected(_)) => Err(Some("its stdin is closed".to_string())),
                },
                None => Err(Some("its stdin is closed".to_string())),
            }
        };
        let message = match result {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => Some(e.to_string()),
            Err(e) => e,
        };
        let message = match (message, exit_status(&mut self.conversation().child)) {
            (_, Some(status)) => format!("the {} exited ({status}) before answering {what}", self.role).into(),
            (Some(e), None) => format!("{what}: cannot send: {e}").into(),
            (None, None) => text!(
                format!("timed out after {} s (", self.timeout.as_secs_f64()),
                crate::settings::TIMEOUT,
                format!(
                    ") sending {what}: the {role} stopped reading its stdin; the {role} was killed",
                    role = self.role
                )
            ),
        };
        Err(self.fail(message))
    }

    /// The first line, parsed as a handshake and checked by `validate`; the process is killed
    /// and the error quotes the line when it is not one.
    pub(crate) fn handshake<H: serde::de::DeserializeOwned>(
        &self,
        validate: impl Fn(&H) -> std::result::Result<(), ProtocolError>,
    ) -> Result<H> {
        let line = self.receive_line("its handshake")?;
        let shown = excerpt_long(&line);
        if !line.trim_start().starts_with('{') {
            // Almost always a print() in the router's own code: stdout is the protocol channel.
            return Err(self.fail(format!(
                "wrote `{shown}` on stdout before its handshake: stdout carries the protocol only; print to stderr instead (Python: print(..., file=sys.stderr))"
            )));
        }
        serde_json::from_str(&line)
            .map_err(|e| excerpt_long(&e))
            .and_then(|h: H| validate(&h).map(|()| h).map_err(|e| e.to_string()))
            .map_err(|e| self.fail(format!("bad handshake ({e}): `{shown}`")))
    }

    /// The next request id, or the error that stopped the conversation.
    pub(crate) fn next_id(&self) -> Result<u64> {
        let mut conv = self.conversation();
        if let Some(failed) = &conv.failed {
            return Err(self.error(format!("stopped after an earlier error: {failed}")));
        }
        let id = conv.next_id;
        conv.next_id += 1;
        Ok(id)
    }

    /// The longest line or payload the process may send.
    pub(crate) fn read_limit(&self) -> usize {
        self.read_limit
    }
}

impl Subprocess {
    /// One request and its answer, in the handshake's protocol; `placement` (a router with
    /// `ranks`) puts the sequences on ranks, else the router's default does.
    fn call(
        &self,
        mode: Mode,
        rows: ArrayView3<f32>,
        padding: Option<ArrayView2<bool>>,
        placement: Option<&[usize]>,
    ) -> Result<Routing> {
        let (batch, seq_len, width) = rows.dim();
        let hs = &self.handshake;
        let ranks = hs.ranks();
        if !batch.is_multiple_of(ranks) {
            return Err(Error::shape(
                &format!("router `{}`", hs.name),
                format!("a batch of {batch} sequences, not a multiple of its {ranks} ranks"),
            ));
        }
        if let Some(p) = placement {
            let checked = match hs.ranks {
                Some(n) => protocol::check_placement(p, batch, n),
                None => Err("a placement for a router that declared no `ranks`".into()),
            };
            checked.map_err(|e| Error::shape(&format!("router `{}`", hs.name), e))?;
        }
        if width != hs.row_width() {
            return Err(Error::shape(
                &format!("router `{}`", hs.name),
                format!("rows of {width} values, the router takes {}", hs.row_width()),
            ));
        }
        if let Some(m) = padding.filter(|m| m.dim() != (batch, seq_len) || !hs.padding_mask) {
            return Err(Error::shape(
                &format!("router `{}`", hs.name),
                format!("a padding mask of {:?} for rows of {batch} x {seq_len}, or a router that takes none", m.dim()),
            ));
        }
        moe_audit_core::routing::scores::check_finite(&rows)?;
        let rows = rows.as_standard_layout();
        let flat = rows.as_slice().expect("standard layout");
        let mask: Option<Vec<bool>> = padding.map(|m| m.iter().copied().collect());
        let id = self.peer.next_id()?;
        let message = if hs.framed() {
            frame_request((id, mode, self.seed), (batch, seq_len, width), flat, mask.as_deref(), placement)
        } else {
            let request = Request { id, mode, batch, seq_len, data: flat.chunks(width.max(1)).collect() };
            let mut line = serde_json::to_vec(&request).expect("a request always serialises");
            line.push(b'\n');
            line
        };
        let what = format!("request {id} ({mode}, batch {batch} x seq_len {seq_len})");
        self.peer.send(message, &what)?;
        let line = self.peer.receive_line(&what)?;
        let fail = |e: ProtocolError| self.peer.fail(text!(format!("{what}: "), e));
        let response = if hs.binary_responses() {
            let header = BinaryHeader::parse(&line).map_err(fail)?;
            let len = header.payload_len(hs, batch * seq_len, self.peer.read_limit as u64).map_err(fail)?;
            let payload = self.peer.receive_bytes(len, &what)?;
            header.decode(&payload, batch * seq_len).map_err(fail)?
        } else {
            parse_response(&line).map_err(fail)?
        };
        let logits = (hs.input == InputKind::Logits).then_some(flat);
        let asked = Asked { id, batch, seq_len, padding: padding.as_ref().map(|m| m.view()), logits, placement };
        response.into_routing(hs, &asked).map_err(fail)
    }
}

/// The stderr line an error quotes: the last a failing rank wrote (`moe-audit: rank R: ...`;
/// a launcher such as torchrun writes its summary after it), else the last line.
fn last_words(tail: &str) -> Option<&str> {
    tail.lines().rev().find(|l| l.starts_with(RANK_LINE)).or_else(|| tail.lines().last())
}

/// Exactly `n` bytes from `reader`, or an error saying where they ended.
fn read_payload(reader: &mut impl Read, n: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(n);
    reader.take(n as u64).read_to_end(&mut buf)?;
    if buf.len() < n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("its output ended after {} of the payload's {n} bytes", buf.len()),
        ));
    }
    Ok(buf)
}

/// The child's status once it exits within a moment, else that it is still running.
fn wait_briefly(child: &mut Child) -> String {
    exit_status(child).map_or_else(|| "still running".to_string(), |s| s.to_string())
}

/// The child's exit status, if it exits within a moment (it closed its stdin).
fn exit_status(child: &mut Child) -> Option<std::process::ExitStatus> {
    for _ in 0..50 {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// Closes the router's stdin, kills its tree and reaps it (unregistered first: once reaped,
/// its pid may be reused).
fn stop(conv: &mut Conversation, tag: &str) {
    drop(conv.requests.take());
    if std::mem::replace(&mut conv.stopped, true) {
        return;
    }
    let pid = conv.child.id() as i32;
    kill_tree(pid, tag);
    LIVE.lock().unwrap_or_else(|e| e.into_inner()).retain(|(p, _)| *p != pid);
    let _ = conv.child.kill();
    let _ = conv.child.wait();
}

/// SIGKILLs the process group `pid` leads, every descendant of `pid`, and every process tagged
/// `tag`, until none is left (a process forking while it is killed is caught on the next
/// round). Linux reads descendants and tags from `/proc`; elsewhere only the group is killed.
fn kill_tree(pid: i32, tag: &str) {
    let me = std::process::id() as i32;
    for _ in 0..100 {
        // SAFETY: kill(2) on the router's own process group; no memory is touched.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        let victims: Vec<i32> = tree(pid, tag).into_iter().filter(|&p| p != me).collect();
        if victims.is_empty() {
            return;
        }
        for &p in &victims {
            // SAFETY: kill(2) on a process of the router's tree; no memory is touched.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Live processes in `root`'s group, below it, or carrying `tag` (zombies are already dead).
fn tree(root: i32, tag: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let needle = format!("{TAG_VAR}={tag}");
    let mut parent = std::collections::HashMap::new();
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp ...`: comm may hold spaces and parentheses, so split
        // after the last `)`.
        let rest: Vec<&str> = stat.rsplit_once(')').map_or(Vec::new(), |(_, r)| r.split_whitespace().take(3).collect());
        let [state, ppid, pgrp] = rest[..] else { continue };
        if state == "Z" || state == "X" {
            continue;
        }
        if let Ok(ppid) = ppid.parse::<i32>() {
            parent.insert(pid, ppid);
        }
        if pgrp.parse::<i32>() == Ok(root) {
            out.push(pid);
        } else if pid != root {
            let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
            if environ.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
                out.push(pid);
            }
        }
    }
    let below = |mut p: i32| {
        for _ in 0..parent.len() {
            match parent.get(&p) {
                Some(&pp) if pp == root => return true,
                Some(&pp) if pp > 1 => p = pp,
                _ => return false,
            }
        }
        false
    };
    out.extend(parent.keys().copied().filter(|&p| p == root || below(p)));
    out.sort_unstable();
    out.dedup();
    out
}

impl Drop for Peer {
    fn drop(&mut self) {
        // A panic mid-call poisons the lock; the child must still be killed, and a panic in
        // drop during unwinding would abort.
        let conv = self.conversation.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        stop(conv, &self.tag);
    }
}

impl Answers for Subprocess {
    fn handshake(&self) -> &Handshake {
        &self.handshake
    }

    fn answer(&self, mode: Mode, rows: ArrayView3<f32>, padding: Option<ArrayView2<bool>>) -> Result<Routing> {
        self.call(mode, rows, padding, None)
    }

    fn answer_placed(
        &self,
        mode: Mode,
        rows: ArrayView3<f32>,
        padding: Option<ArrayView2<bool>>,
        placement: &[usize],
    ) -> Result<Routing> {
        self.call(mode, rows, padding, Some(placement))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_rank_is_quoted_before_the_launcher_summary() {
        let tail = "moe-audit: rank 1: RuntimeError: boom\nmoe-audit: rank 0: did not answer\nERROR torchrun: failed";
        assert_eq!(last_words(tail), Some("moe-audit: rank 0: did not answer"));
        assert_eq!(last_words("a\nb"), Some("b"));
        assert_eq!(last_words(""), None);
    }

    #[test]
    fn timeouts_are_checked() {
        assert_eq!(timeout(1.5).unwrap(), Duration::from_millis(1500));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let e = timeout(bad).unwrap_err().to_string();
            assert!(e.starts_with("setting `timeout` must be"), "{e}");
        }
    }

    #[test]
    fn dropping_after_a_panic_mid_call_kills_the_child() {
        let hello = r#"{"protocol":"moe-audit/1","name":"t","experts":2,"top_k":1,"input":"logits"}"#;
        let router = ExternalRouter::spawn(
            &format!("echo '{hello}'; exec sleep 60"),
            Duration::from_secs(10),
            0,
            Mode::Train,
            MemoryBudget::new(u64::MAX),
        )
        .expect("handshake");
        let source = router.source();
        let pid = source.peer.conversation.lock().expect("fresh lock").child.id();
        // A panic while holding the conversation poisons its lock.
        let panicked = std::thread::scope(|s| {
            s.spawn(|| {
                let _held = source.peer.conversation.lock();
                panic!("a call panicked");
            })
            .join()
        });
        assert!(panicked.is_err() && source.peer.conversation.is_poisoned());
        drop(router);
        // The child was killed and reaped: its pid is gone (or at least no longer a sleeper).
        let alive = std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| !s.contains("(zombie)"));
        assert!(!alive, "child {pid} survived the drop");
    }
}
