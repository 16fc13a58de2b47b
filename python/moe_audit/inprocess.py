"""Audits a router of this process: ``moe-audit check`` runs as a subprocess whose router
command relays the protocol through two named pipes to a thread here. A test suite then imports
torch and builds its models once, not once per audited router."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import threading
from typing import Any

from .adapter import describe, serve
from .binary import binary


def _unblock(requests: str, responses: str) -> None:
    """Releases a serving thread still waiting to open the pipes (moe-audit never started the
    router): opening the other ends without blocking lets its open return, then it reads EOF."""
    for path, flags in ((requests, os.O_WRONLY), (responses, os.O_RDONLY)):
        try:
            os.close(os.open(path, flags | os.O_NONBLOCK))
        except OSError:
            pass


def check(router: Any, *args: Any, timeout: float = 900, **spec: Any) -> subprocess.CompletedProcess[str]:
    """Runs ``moe-audit check --router-cmd RELAY ARGS...`` (``--model-cmd`` for a whole model)
    against ``router`` served from this
    process, and returns the ``subprocess.CompletedProcess`` (text stdout and stderr; exit code 0
    no leak, 1 leak, 2 error).

    ``router`` is as for :func:`moe_audit.snapshot.routing_snapshot`: a ``route`` function with
    ``experts``, ``top_k``, ... keywords, or an object with a ``route`` method and those
    attributes (``moe_audit.hf.wrap`` returns one). ``args`` are the check's own flags, e.g.
    ``"--format", "json", "--probes", "D,S"``. An exception raised by the router is raised here
    (after moe-audit has stopped). ``timeout`` bounds the whole audit, in seconds.
    """
    spec = dict(spec)
    if callable(getattr(router, "serve", None)):
        # A whole model (moe_audit.hf.wrap of a model taking token ids) serves moe-audit/3 itself.
        if spec:
            raise TypeError(f"unknown options: {', '.join(sorted(spec))}")
        flag, answer_streams = "--model-cmd", router.serve
        name = getattr(router, "name", None) or type(router).__name__
    else:
        route, hs = describe(router, spec)
        if spec:
            raise TypeError(f"unknown options: {', '.join(sorted(spec))}")
        flag, answer_streams = "--router-cmd", lambda inp, out: serve(route, stdin=inp, stdout=out, **hs)
        name = hs["name"]
    with tempfile.TemporaryDirectory(prefix="moe-audit-check-") as directory:
        requests = os.path.join(directory, "requests")
        responses = os.path.join(directory, "responses")
        os.mkfifo(requests)
        os.mkfifo(responses)
        failure: list[BaseException] = []

        def answer() -> None:
            try:
                with open(requests, "rb") as inp, open(responses, "wb") as out:
                    answer_streams(inp, out)
            except BrokenPipeError:
                pass  # moe-audit stopped reading: it reports why
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                failure.append(e)

        thread = threading.Thread(target=answer, name="moe-audit-router", daemon=True)
        thread.start()
        relay = f"cat {shlex.quote(responses)} & exec cat > {shlex.quote(requests)}"
        try:
            proc = subprocess.run(
                [binary(), "check", flag, relay, *map(str, args)],
                capture_output=True, text=True, timeout=timeout,
            )
        finally:
            _unblock(requests, responses)
            thread.join(timeout=60)
        if failure:
            raise failure[0]
        # Messages name the router's command: here the relay, which means nothing to the user.
        label = f"{name} (served in this Python process)"
        proc.stdout, proc.stderr = (text.replace(relay, label) for text in (proc.stdout, proc.stderr))
        return proc
