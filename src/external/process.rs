//! A router in another process, spoken to over `moe-audit/1` on its stdin and stdout.
//!
//! One reader thread turns the child's stdout into lines on a channel, so every wait has a
//! timeout: a router that hangs, crashes or answers garbage ends the audit with an error naming
//! the request, and the child is killed. Calls are serialised (one child, one conversation) and
//! the router tells the analyzer not to run them concurrently, so request ids and the order a
//! stateful router sees are the same on every run.

use super::protocol::{parse_response, Handshake, InputKind, Mode, Request, PROTOCOL};
use super::{Answers, External};
use crate::error::{Error, Result};
use crate::routing::Routing;
use ndarray::ArrayView3;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How much of the child's stderr is kept for error messages.
const STDERR_TAIL: usize = 2000;

/// The live conversation.
struct Conversation {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<std::io::Result<String>>,
    next_id: u64,
    /// Set once an error stopped the child: later calls fail with it.
    failed: Option<String>,
}

/// A router process and the conversation with it.
pub struct Subprocess {
    command: String,
    timeout: Duration,
    handshake: Handshake,
    stderr: Arc<Mutex<Vec<u8>>>,
    /// Disconnects when the stderr reader has seen the end of the pipe.
    stderr_done: Mutex<Receiver<()>>,
    conversation: Mutex<Conversation>,
}

/// A router behind a command (`--router-cmd "python3 my_router.py"`).
pub type ExternalRouter = External<Subprocess>;

impl ExternalRouter {
    /// Spawns `command` with `sh -c`, reads its handshake, and (for `input: hidden`) finds the
    /// targeted rows from a seeded pool (at most `max_memory` bytes). `timeout` bounds the
    /// handshake and every request.
    pub fn spawn(command: &str, timeout: Duration, seed: u64, max_memory: u64) -> Result<Self> {
        let mut child = Command::new("sh");
        // Its own process group, so killing it also kills what `sh -c` started.
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut child, 0);
        let mut child = child
            .args(["-c", command])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::input(format!("router `{command}`"), format!("cannot start: {e}")))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let mut err_pipe = child.stderr.take().expect("piped");
        let sink = Arc::clone(&stderr);
        let (done, stderr_done) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            let _done = done;
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = err_pipe.read(&mut buf) {
                let mut tail = sink.lock().expect("stderr buffer");
                tail.extend_from_slice(&buf[..n]);
                let excess = tail.len().saturating_sub(STDERR_TAIL);
                tail.drain(..excess);
            }
        });
        let stdin = child.stdin.take();
        let placeholder = Handshake {
            protocol: PROTOCOL.into(),
            name: String::new(),
            experts: 1,
            top_k: None,
            input: InputKind::Logits,
            hidden_size: None,
        };
        let mut shared = Subprocess {
            command: command.to_string(),
            timeout,
            handshake: placeholder,
            stderr,
            stderr_done: Mutex::new(stderr_done),
            conversation: Mutex::new(Conversation { child, stdin, lines, next_id: 1, failed: None }),
        };
        let line = shared.receive("its handshake")?;
        let handshake: Handshake = serde_json::from_str(&line)
            .map_err(|e| e.to_string())
            .and_then(|h: Handshake| h.validate().map(|()| h))
            .map_err(|e| {
                shared.fail(format!("bad handshake ({e}): `{}`", line.chars().take(120).collect::<String>()))
            })?;
        shared.handshake = handshake;
        External::new(shared, seed, true, max_memory)
    }
}

impl Subprocess {
    fn error(&self, message: String) -> Error {
        Error::input(format!("router `{}`", self.command), message)
    }

    /// Kills the child and returns the error (with the tail of its stderr, if any).
    fn fail(&self, message: String) -> Error {
        let mut conv = self.conversation.lock().expect("conversation");
        kill(&mut conv.child);
        // The group is dead: its stderr ends at once; read what it said last.
        let _ = self.stderr_done.lock().expect("stderr reader").recv_timeout(Duration::from_secs(1));
        let tail = String::from_utf8_lossy(&self.stderr.lock().expect("stderr buffer")).trim().to_string();
        let message = match tail.lines().last() {
            Some(last) if !last.is_empty() => format!("{message}; its stderr ends: {last}"),
            _ => message,
        };
        conv.failed = Some(message.clone());
        self.error(message)
    }

    /// The next line; `what` is `its handshake` or `request N (...)`.
    fn receive(&self, what: &str) -> Result<String> {
        let (waiting_for, before) = match what.starts_with("request") {
            true => (format!("the answer to {what}"), format!("answering {what}")),
            false => (what.to_string(), what.to_string()),
        };
        let got = self.conversation.lock().expect("conversation").lines.recv_timeout(self.timeout);
        match got {
            Ok(Ok(line)) => Ok(line),
            Ok(Err(e)) => Err(self.fail(format!("reading {what}: {e}"))),
            Err(RecvTimeoutError::Timeout) => Err(self.fail(format!(
                "timed out after {} s (--timeout) waiting for {waiting_for}; the router was killed",
                self.timeout.as_secs_f64()
            ))),
            Err(RecvTimeoutError::Disconnected) => {
                let status = {
                    let mut conv = self.conversation.lock().expect("conversation");
                    conv.child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string())
                };
                Err(self.fail(format!("the router exited ({status}) before {before}")))
            }
        }
    }

    fn call(&self, mode: Mode, rows: ArrayView3<f32>) -> Result<Routing> {
        let (batch, seq_len, width) = rows.dim();
        let hs = &self.handshake;
        if width != hs.row_width() {
            return Err(Error::shape(
                &format!("router `{}`", hs.name),
                format!("rows of {width} values, the router takes {}", hs.row_width()),
            ));
        }
        crate::routing::scores::check_finite(&rows)?;
        let rows = rows.as_standard_layout();
        let flat = rows.as_slice().expect("standard layout");
        let id = {
            let mut conv = self.conversation.lock().expect("conversation");
            if let Some(failed) = &conv.failed {
                return Err(self.error(format!("stopped after an earlier error: {failed}")));
            }
            let id = conv.next_id;
            conv.next_id += 1;
            let request = Request { id, mode, batch, seq_len, data: flat.chunks(width).collect() };
            let mut line = serde_json::to_vec(&request).expect("a request always serialises");
            line.push(b'\n');
            let sent = conv.stdin.as_mut().map(|pipe| pipe.write_all(&line).and_then(|()| pipe.flush()));
            if let Some(Err(e)) = sent {
                let what = format!("request {id} ({mode}, batch {batch} x seq_len {seq_len})");
                let message = match exit_status(&mut conv.child) {
                    Some(status) => format!("the router exited ({status}) before answering {what}"),
                    None => format!("{what}: cannot send: {e}"),
                };
                drop(conv);
                return Err(self.fail(message));
            }
            id
        };
        let what = format!("request {id} ({mode}, batch {batch} x seq_len {seq_len})");
        let line = self.receive(&what)?;
        let logits = (hs.input == InputKind::Logits).then_some(flat);
        parse_response(&line)
            .and_then(|r| r.into_routing(hs, (id, batch, seq_len), logits))
            .map_err(|e| self.fail(format!("{what}: {e}")))
    }
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

fn kill(child: &mut Child) {
    #[cfg(unix)]
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on the child's own process group; no memory is touched.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Subprocess {
    fn drop(&mut self) {
        let conv = self.conversation.get_mut().expect("conversation");
        drop(conv.stdin.take());
        kill(&mut conv.child);
    }
}

impl Answers for Subprocess {
    fn handshake(&self) -> &Handshake {
        &self.handshake
    }

    fn answer(&self, mode: Mode, rows: ArrayView3<f32>) -> Result<Routing> {
        self.call(mode, rows)
    }
}
