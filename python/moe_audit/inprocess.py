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
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Literal, Union

from .adapter import Protocol, Router, describe, serve
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


@typing.runtime_checkable
class ServesItself(typing.Protocol):
    """A whole model that speaks ``moe-audit/3`` itself (``moe_audit.hf.wrap`` of a model taking
    token ids), optionally with a ``name``."""

    def serve(self, stdin: BinaryIO, stdout: BinaryIO, /) -> None: ...


#: A probe's verdict, as the report spells it.
Verdict = Literal["pass", "leak", "latent", "drift", "inconclusive", "not-applicable"]


@dataclass(frozen=True)
class Finding:
    """One probe's finding: the fields a router's and a whole model's findings share, and the
    finding whole as the report has it (:attr:`fields`: a router's ``compared``, ``affected``,
    ``rate``, ...; a whole model's ``cases``, ``layers``, ``outputs``, ...)."""

    #: The probe's letter (``P``, ``F``, ...).
    probe: str
    #: ``pass``, ``leak``, ``latent``, ``drift``, ``inconclusive`` or ``not-applicable``.
    verdict: Verdict
    #: The property the probe tests (``C-length``, ``D``, ...).
    property: str
    #: One line on what was done, or why the probe does not apply.
    note: str
    #: A minimal pair of inputs that reproduces a leak (``moe-audit replay`` replays it), or None.
    witness: dict[str, Any] | None
    #: The finding as the report's JSON has it.
    fields: dict[str, Any]

    @classmethod
    def of(cls, finding: dict[str, Any]) -> Finding:
        return cls(finding["probe"], finding["verdict"], finding["property"], finding["note"], finding["witness"],
                   finding)

    def __getitem__(self, key: str) -> Any:
        """``finding["probe"]``, as when findings were dicts: deprecated (0.3.0; removed in 0.4.0),
        read the attribute or :attr:`fields`."""
        warnings.warn("Report.findings are Finding objects: read finding.probe, finding.verdict, ... or "
                      "finding.fields[key] (finding[key] is deprecated)", DeprecationWarning, stacklevel=2)
        return self.fields[key]


class Report:
    """What ``moe-audit check`` found about the router (or whole model) served from this
    process, parsed from its JSON report: :attr:`findings` (one :class:`Finding` per probe, in
    the report's order), :attr:`verdicts` (``{probe: verdict}``), :attr:`leaks` (the probes whose
    verdict is ``"leak"``), :attr:`latent` (those whose verdict is ``"latent"``: only the
    capacity in force changed), :attr:`failed` (a verdict of ``fail_on`` was found: exit code
    1), :attr:`exit_code` (0 or 1) and :meth:`to_dict`, the whole document."""

    def __init__(self, document: dict[str, Any], exit_code: int, stderr: str = "") -> None:
        if exit_code not in (0, 1):
            raise ValueError(f"a report's exit code is 0 or 1, got {exit_code}")
        self._document = document
        #: The command's exit code: 0 nothing of ``fail_on`` found, 1 found.
        self.exit_code = exit_code
        #: What moe-audit wrote to stderr (warnings, notes).
        self.stderr = stderr
        # A router's findings are under its entry of "routers"; a whole model's at the top.
        routers = document.get("routers") or [{}]
        #: One :class:`Finding` per probe, in the report's order.
        self.findings: list[Finding] = [Finding.of(f) for f in document.get("findings", routers[0].get("findings", []))]
        #: ``{probe: verdict}``.
        self.verdicts: dict[str, str] = {f.probe: f.verdict for f in self.findings}
        #: The probes that found a leak (a changed decision or output).
        self.leaks: list[str] = [f.probe for f in self.findings if f.verdict == "leak"]
        #: The probes that found only the capacity in force changed, no decision (``latent``).
        self.latent: list[str] = [f.probe for f in self.findings if f.verdict == "latent"]

    @property
    def failed(self) -> bool:
        """Whether the check failed (exit code 1): a verdict of ``fail_on`` (default
        ``leak,latent``)."""
        return self.exit_code == 1

    def finding(self, probe: str) -> Finding:
        """The finding of this probe (KeyError when the probe did not run)."""
        for f in self.findings:
            if f.probe == probe:
                return f
        raise KeyError(f"no finding of probe {probe!r}: the report has {', '.join(self.verdicts) or 'none'}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON document ``moe-audit check --format json`` printed (a copy)."""
        copy: dict[str, Any] = json.loads(json.dumps(self._document))
        return copy

    def __repr__(self) -> str:
        verdicts = " ".join(f"{p}={v}" for p, v in self.verdicts.items())
        return f"<Report failed={self.failed} exit_code={self.exit_code} {verdicts}>"


#: A list of probes or verdicts: ``"P,F"`` or ``["P", "F"]``.
Letters = Union[str, Sequence[str]]

#: The typed options of :func:`check`: keyword -> (moe-audit's flag, the commands that take it:
#: ``check`` audits a router, ``model`` a whole model). The one place a keyword's flag is spelt.
_OPTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "probes": ("--probes", ("check", "model")),
    "batch": ("--batch", ("check", "model")),
    "seq_len": ("--seq-len", ("check", "model")),
    "hidden": ("--hidden", ("check", "model")),
    "ffn": ("--ffn", ("check", "model")),
    "trials": ("--trials", ("check", "model")),
    "seed": ("--seed", ("check", "model")),
    "fail_on": ("--fail-on", ("check", "model")),
    "exhaustive": ("--exhaustive", ("check",)),
    "mode": ("--mode", ("check",)),
    "ranks": ("--ranks", ("check",)),
    "prefill": ("--prefill", ("model",)),
    "max_memory": ("--max-memory", ("check", "model")),
    "witness_dir": ("--witness-dir", ("check", "model")),
    "answer_timeout": ("--timeout", ("check", "model")),
}
_AUDITED = {"check": "a router", "model": "a whole model"}


def _option_args(options: dict[str, object], subcommand: str) -> list[str]:
    """The flags of the options given (not None; a bool option when True), in the table's order."""
    out: list[str] = []
    for key, (flag, commands) in _OPTIONS.items():
        value = options[key]
        if value is None or value is False:
            continue
        if subcommand not in commands:
            raise TypeError(f"{key}= is not an option of the audit of {_AUDITED[subcommand]} "
                            f"(only of {' and '.join(_AUDITED[c] for c in commands)}'s)")
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return out


#: Options of ``moe-audit check`` that change what it prints, which :func:`check` parses.
_OUTPUT_OPTIONS = ("--output", "--github")


def _deprecated_args(args: tuple[str, ...]) -> list[str]:
    """The check's own flags given as strings (deprecated: the keywords replace them), without
    ``--format json``; those that change what is printed are refused: the report is read as JSON
    from stdout."""
    warnings.warn("moe_audit.check(router, \"--flag\", \"value\", ...): flags as strings are deprecated (0.3.0; "
                  "removed in 0.4.0): pass keywords (probes=\"P,F\", batch=2, seq_len=32, ...)",
                  DeprecationWarning, stacklevel=3)
    out = [str(a) for a in args]
    own = []
    skip = False
    for i, a in enumerate(out):
        if skip:
            skip = False
            continue
        name, eq, value = a.partition("=")
        if name == "--format":
            skip = not eq
            value = value if eq else (out[i + 1] if i + 1 < len(out) else "")
            if value != "json":
                raise ValueError(f"check parses the JSON report: --format {value} is not taken (read the Report)")
            continue
        if name in _OUTPUT_OPTIONS:
            raise ValueError(f"check reads the report from moe-audit's stdout: {name} is not taken")
        own.append(a)
    return own


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


def check(router: Router | ServesItself, *args: str, probes: Letters | None = None, batch: int | None = None,
          seq_len: int | None = None, hidden: int | None = None, ffn: int | None = None, trials: int | None = None,
          seed: int | None = None, fail_on: Letters | None = None, exhaustive: bool = False,
          mode: Literal["train", "inference"] | None = None, ranks: int | None = None, prefill: int | None = None,
          max_memory: str | None = None, witness_dir: str | os.PathLike[str] | None = None,
          answer_timeout: float | None = None, timeout: float = 900, name: str | None = None,
          experts: int | None = None, top_k: int | None = None, input: Literal["logits", "hidden"] | None = None,
          hidden_size: int | None = None, protocol: Protocol | None = None,
          padding_mask: bool | None = None) -> Report:
    """Runs ``moe-audit check --router-cmd ... --format json`` (``moe-audit model --model-cmd ...`` for
    a whole model) against ``router`` served from this process, and returns its :class:`Report`
    (exit code 0 or 1). An error of moe-audit (exit code 2) raises :class:`CheckError` with its
    message; an exception raised by the router is raised here (after moe-audit has stopped).

    ``router`` is as for :func:`moe_audit.snapshot.routing_snapshot`: a ``route`` function, or
    an object with a ``route`` method and the attributes ``experts``, ``top_k``, ...
    (``moe_audit.hf.wrap`` returns one, or a whole model, which serves itself).

    The audit, each as the command's flag of that name (docs/CLI.md; None: its default):
    ``probes`` and ``fail_on`` (``"P,F"`` or ``["P", "F"]``), ``batch``, ``seq_len``, ``hidden``,
    ``ffn``, ``trials``, ``seed``, ``exhaustive``, ``max_memory`` (``"4GiB"``), ``witness_dir``;
    a router's only: ``mode`` (``"train"`` or ``"inference"``), ``ranks``; a whole model's only:
    ``prefill``. ``answer_timeout``: seconds to wait for each answer (``--timeout``, default 60);
    ``timeout`` bounds the whole audit, in seconds (``subprocess.TimeoutExpired`` after it).

    The router, for a route function (an object's attributes otherwise): ``name``, ``experts``
    (required), ``top_k``, ``input``, ``hidden_size``, ``protocol``, ``padding_mask``, as
    :func:`moe_audit.run` takes them.

    ``args``: the flags as strings (``"--probes", "D,S"``) are deprecated since 0.3.0 (a
    ``DeprecationWarning``) and removed in 0.4.0: pass the keywords.
    """
    answer_streams: Callable[[BinaryIO, BinaryIO], None]
    spec = {k: v for k, v in (("name", name), ("experts", experts), ("top_k", top_k), ("input", input),
                               ("hidden_size", hidden_size), ("protocol", protocol),
                               ("padding_mask", padding_mask)) if v is not None}
    if isinstance(router, ServesItself):
        # A whole model (moe_audit.hf.wrap of a model taking token ids) serves moe-audit/3 itself.
        if spec:
            raise TypeError(f"{', '.join(f'{k}=' for k in spec)}: a whole model describes itself")
        subcommand, flag, answer_streams = "model", "--model-cmd", router.serve
        label = getattr(router, "name", None) or type(router).__name__
    else:
        route, hs = describe(router, spec)
        subcommand, flag = "check", "--router-cmd"

        def answer_streams(inp: BinaryIO, out: BinaryIO) -> None:
            serve(route, stdin=inp, stdout=out, **hs)

        label = hs["name"]
    own = _option_args({"probes": probes, "batch": batch, "seq_len": seq_len, "hidden": hidden, "ffn": ffn,
                        "trials": trials, "seed": seed, "fail_on": fail_on, "exhaustive": exhaustive, "mode": mode,
                        "ranks": ranks, "prefill": prefill, "max_memory": max_memory, "witness_dir": witness_dir,
                        "answer_timeout": answer_timeout}, subcommand)
    own = ["--format", "json", *own, *(_deprecated_args(args) if args else [])]
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
    label = f"{label} (served in this Python process)"
    handover = re.compile(re.escape(command) + "|" + re.escape(command[:8]) + r"[^`]*…\[\d+ chars in all\]…[^`]*")
    stdout, stderr = (handover.sub(lambda _: label, text) for text in (proc.stdout, proc.stderr))
    if proc.returncode not in (0, 1):
        # The error is its last line (notes and warnings may come before it).
        lines = stderr.strip().splitlines()
        message = lines[-1] if lines else f"moe-audit check exited with {proc.returncode}"
        raise CheckError(message.removeprefix("error: "), stderr)
    return Report(json.loads(stdout), proc.returncode, stderr)
