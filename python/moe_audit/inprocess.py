"""Audits a router of this process: ``moe-audit check`` runs as a subprocess, and the router
command it starts hands its stdin and stdout to a thread here, which serves the protocol on them
directly. A test suite then imports torch and builds its models once, not once per audited
router.

The hand-over: the router command is a few lines of Python (``-I -S``: no site, no imports
beyond ``socket``) that connects to a Unix socket this process listens on (in the abstract
namespace on Linux: no file; elsewhere in a temporary directory, removed after), sends its
stdin and stdout as file descriptors (``SCM_RIGHTS``), points its own at ``/dev/null`` and
waits for the connection to close. The protocol then flows between moe-audit and this process
with nothing copying it in between, and when this process closes the streams moe-audit sees
the end of its router's output at once.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, BinaryIO, Callable

from .adapter import describe, serve
from .binary import binary
from .errors import MoeAuditError

#: The router command's code: connect, send fds 0 and 1, let go of them, wait for the end.
#: No quote or backslash in it, so that shell-quoted it is one single-quoted word, and a JSON
#: message quoting it quotes it as is. argv: the socket's address, how long to wait (the audit's
#: timeout: the command lives as long as moe-audit talks to this process).
_HANDOVER = (
    "import os,socket,sys;"
    "s=socket.socket(socket.AF_UNIX);s.settimeout(float(sys.argv[2]));"
    "a=sys.argv[1];s.connect(chr(0)+a[1:] if a[0]==chr(64) else a);"
    "socket.send_fds(s,[bytes(1)],[0,1]);"
    "n=os.open(os.devnull,os.O_RDWR);os.dup2(n,0);os.dup2(n,1);"
    "s.recv(1)"
)
#: How long moe-audit's router command may take to connect and hand its streams over, in seconds.
_CONNECT_TIMEOUT = 60.0
#: How long the serving thread may take to stop once moe-audit has, in seconds.
_JOIN_TIMEOUT = 60.0


class CheckError(MoeAuditError, ValueError):
    """``moe-audit check`` stopped with an error (exit code 2: bad options, a router that
    answered wrongly or hung): the message is the line it printed after ``error:``, naming the
    router served here."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        #: Everything moe-audit wrote to stderr.
        self.stderr = stderr
        #: The command's exit code: 2.
        self.exit_code = 2


class Report:
    """What ``moe-audit check`` found about the router (or whole model) served from this
    process, parsed from its JSON report: :attr:`verdicts` (``{probe: verdict}``, in the
    report's order), :attr:`leaks` (the probes whose verdict is ``"leak"``), :attr:`latent` (those
    whose verdict is ``"latent"``: only the capacity in force changed), :attr:`failed`
    (a verdict of ``--fail-on`` was found: exit code 1), :attr:`exit_code` (0 or 1),
    :attr:`findings` (one dict per probe, as the report has them) and :meth:`to_dict`, the
    whole document."""

    def __init__(self, document: dict[str, Any], exit_code: int, stderr: str = "") -> None:
        if exit_code not in (0, 1):
            raise ValueError(f"a report's exit code is 0 or 1, got {exit_code}")
        self._document = document
        #: The command's exit code: 0 nothing of ``--fail-on`` found, 1 found.
        self.exit_code = exit_code
        #: What moe-audit wrote to stderr (warnings, notes).
        self.stderr = stderr
        # A router's findings are under its entry of "routers"; a whole model's at the top.
        routers = document.get("routers") or [{}]
        #: One dict per probe: ``probe``, ``verdict``, ``property``, the counts, ``note``, ...
        self.findings: list[dict[str, Any]] = list(document.get("findings", routers[0].get("findings", [])))
        #: ``{probe: verdict}``: ``pass``, ``leak``, ``latent``, ``drift``, ``inconclusive`` or
        #: ``not-applicable``.
        self.verdicts: dict[str, str] = {f["probe"]: f["verdict"] for f in self.findings}
        #: The probes that found a leak (a changed decision or output).
        self.leaks: list[str] = [p for p, v in self.verdicts.items() if v == "leak"]
        #: The probes that found only the capacity in force changed, no decision (``latent``).
        self.latent: list[str] = [p for p, v in self.verdicts.items() if v == "latent"]

    @property
    def failed(self) -> bool:
        """Whether the check failed (exit code 1): a verdict of ``--fail-on`` (default
        ``leak,latent``)."""
        return self.exit_code == 1

    def to_dict(self) -> dict[str, Any]:
        """The JSON document ``moe-audit check --format json`` printed (a copy)."""
        copy: dict[str, Any] = json.loads(json.dumps(self._document))
        return copy

    def __repr__(self) -> str:
        verdicts = " ".join(f"{p}={v}" for p, v in self.verdicts.items())
        return f"<Report failed={self.failed} exit_code={self.exit_code} {verdicts}>"


#: Options of ``moe-audit check`` that change what it prints, which :func:`check` parses.
_OUTPUT_OPTIONS = ("--output", "--github")


def _check_args(args: tuple[Any, ...]) -> list[str]:
    """The check's own flags as strings, with ``--format json`` unless given; those that change
    what is printed are refused: the report is read as JSON from stdout."""
    out = [str(a) for a in args]
    formats = 0
    for i, a in enumerate(out):
        name, _, value = a.partition("=")
        if name == "--format":
            formats += 1
            value = value or (out[i + 1] if i + 1 < len(out) else "")
            if value != "json":
                raise ValueError(f"check parses the JSON report: --format {value} is not taken (read the Report)")
        elif name in _OUTPUT_OPTIONS:
            raise ValueError(f"check reads the report from moe-audit's stdout: {name} is not taken")
    return out if formats else ["--format", "json", *out]


class _Listener:
    """The Unix socket the router command hands its streams over on: an abstract name on Linux
    (no file), else a file in a temporary directory removed on close."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._directory: tempfile.TemporaryDirectory[str] | None = None
        name = f"moe-audit-check-{secrets.token_hex(16)}"
        if sys.platform == "linux":
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self._directory = tempfile.TemporaryDirectory(prefix="moe-audit-check-")
            self.address = os.path.join(self._directory.name, "s")
            self.sock.bind(self.address)
        self.sock.listen(1)

    def accept(self, stop: threading.Event, deadline: float) -> socket.socket | None:
        """The router command's connection, or None once ``stop`` is set or the deadline passed;
        only a process of this user is accepted (where the platform says who connected)."""
        self.sock.settimeout(0.1)
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            if _same_user(conn):
                return conn
            conn.close()
        return None

    def close(self) -> None:
        self.sock.close()
        if self._directory is not None:
            self._directory.cleanup()


def _same_user(conn: socket.socket) -> bool:
    """Whether the peer runs as this user (Linux: SO_PEERCRED; elsewhere the socket file's
    directory, private to this user, decides)."""
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return True
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i")))
    return bool(uid == os.getuid())


def _answer(listener: _Listener, answer_streams: Callable[[BinaryIO, BinaryIO], None], stop: threading.Event,
            failure: list[BaseException]) -> None:
    """The serving thread: takes the router command's stdin and stdout, serves on them until
    moe-audit closes its end, then lets the router command exit."""
    try:
        conn = listener.accept(stop, time.monotonic() + _CONNECT_TIMEOUT)
        if conn is None:
            return  # moe-audit stopped before it started the router: it says why
        with conn:
            conn.settimeout(_CONNECT_TIMEOUT)
            _, fds, _, _ = socket.recv_fds(conn, 1, 2)
            if len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                raise RuntimeError(f"moe_audit.check: the router command handed over {len(fds)} streams, not 2")
            with os.fdopen(fds[0], "rb") as inp, os.fdopen(fds[1], "wb") as out:
                answer_streams(inp, out)
    except BrokenPipeError:
        pass  # moe-audit stopped reading: it reports why
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        failure.append(e)


def check(router: Any, *args: Any, timeout: float = 900, **spec: Any) -> Report:
    """Runs ``moe-audit check --router-cmd ... --format json ARGS...`` (``moe-audit model --cmd
    ...`` for a whole model) against ``router`` served from this process, and returns its :class:`Report`
    (exit code 0 or 1). An error of moe-audit (exit code 2) raises :class:`CheckError` with its
    message; an exception raised by the router is raised here (after moe-audit has stopped).

    ``router`` is as for :func:`moe_audit.snapshot.routing_snapshot`: a ``route`` function with
    ``experts``, ``top_k``, ... keywords, or an object with a ``route`` method and those
    attributes (``moe_audit.hf.wrap`` returns one). ``args`` are the check's own flags, e.g.
    ``"--probes", "D,S"`` (not ``--output`` or ``--github``: the report is read from stdout).
    ``timeout`` bounds the whole audit, in seconds (``subprocess.TimeoutExpired`` after it).
    """
    spec = dict(spec)
    answer_streams: Callable[[BinaryIO, BinaryIO], None]
    if callable(getattr(router, "serve", None)):
        # A whole model (moe_audit.hf.wrap of a model taking token ids) serves moe-audit/3 itself.
        if spec:
            raise TypeError(f"unknown options: {', '.join(sorted(spec))}")
        subcommand, flag, answer_streams = "model", "--cmd", router.serve
        name = getattr(router, "name", None) or type(router).__name__
    else:
        route, hs = describe(router, spec)
        if spec:
            raise TypeError(f"unknown options: {', '.join(sorted(spec))}")
        subcommand, flag = "check", "--router-cmd"

        def answer_streams(inp: BinaryIO, out: BinaryIO) -> None:
            serve(route, stdin=inp, stdout=out, **hs)

        name = hs["name"]
    own = _check_args(args)
    listener = _Listener()
    try:
        command = shlex.join([sys.executable, "-I", "-S", "-c", _HANDOVER, listener.address, str(float(timeout))])
        failure: list[BaseException] = []
        stop = threading.Event()
        thread = threading.Thread(target=_answer, args=(listener, answer_streams, stop, failure),
                                  name="moe-audit-router", daemon=True)
        thread.start()
        try:
            proc = subprocess.run([binary(), subcommand, flag, command, *own],
                                  capture_output=True, text=True, timeout=timeout)
        finally:
            stop.set()
            thread.join(timeout=_JOIN_TIMEOUT)
    finally:
        listener.close()
    if failure:
        raise failure[0]
    # Messages name the router's command: here the hand-over, which means nothing to the user.
    # moe-audit quotes it whole, or cut to an excerpt when long (`start…[N chars in all]…end`).
    label = f"{name} (served in this Python process)"
    handover = re.compile(re.escape(command) + "|" + re.escape(command[:8]) + r"[^`]*…\[\d+ chars in all\]…[^`]*")
    stdout, stderr = (handover.sub(lambda _: label, text) for text in (proc.stdout, proc.stderr))
    if proc.returncode not in (0, 1):
        # The error is its last line (notes and warnings may come before it).
        lines = stderr.strip().splitlines()
        message = lines[-1] if lines else f"moe-audit check exited with {proc.returncode}"
        raise CheckError(message.removeprefix("error: "), stderr)
    return Report(json.loads(stdout), proc.returncode, stderr)
