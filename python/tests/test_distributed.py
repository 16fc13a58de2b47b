"""moe_audit.distributed: an MoE layer served across the ranks of a ``torch.distributed.run``
launch, spoken to by a minimal client of the protocol (docs/PROTOCOL.md, "Layers over ranks"),
so these tests hold whatever the binary does with the answers.

The framework tests launch the layers as users launch them (2 ranks, gloo, 6-18 s each) and
check each answer against what the framework's source says it computes: the capacity per rank
over its own tokens (megatron-core 0.16.1 ``transformer/moe/router.py:587-595`` with
``moe_utils.py:830-836``; deepspeed 0.19.8 ``moe/sharded_moe.py:152-162``, ``:364``), and the
output rows against a plain-torch reference from the routes and the seeded expert weights (whose
fingerprint is checked against the handshake's, so the reference has the layer's weights).

Needs numpy and torch; the framework tests megatron-core and deepspeed (under CI a skip fails:
conftest.py).
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import moe_audit
from moe_audit import distributed
from moe_audit._wire import v1, v2

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "python" / "examples"
FAKE = Path(__file__).parent / "ep" / "fake_layer.py"


# -- placement, assembly and the wire, without a launch -------------------------------------


def test_default_placements_follow_the_loaders():
    assert distributed.placement("contiguous", 4, 2) == [0, 0, 1, 1]
    assert distributed.placement("strided", 4, 2) == [0, 1, 0, 1]
    assert distributed.placement("strided", 6, 3) == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="a batch of 3 sequences does not split over 2 ranks"):
        distributed.placement("contiguous", 3, 2)
    with pytest.raises(ValueError, match="placement 'random' is not one of contiguous, strided"):
        distributed.placement("random", 4, 2)


@pytest.mark.parametrize("given", [[0, 0, 0, 1], [0, 1, 2, 1], [0, 1, 0], [0, -1, 1, 1], "0011", [0, 1, 0, 1.0]])
def test_a_placement_that_is_not_balanced_is_refused(given):
    with pytest.raises(ValueError, match="placement"):
        distributed._checked_placement(given, 4, 2)
    assert distributed._checked_placement([1, 0, 0, 1], 4, 2) == [1, 0, 0, 1]


def local(experts, kept, capacity, output):
    experts = np.asarray(experts)
    return distributed.Local(experts, np.full(experts.shape, 0.5), np.asarray(kept), capacity,
                             None if output is None else np.asarray(output, dtype=np.float32))


def test_answers_are_assembled_in_the_calls_order():
    # Sequences 0 and 2 on rank 1, 1 and 3 on rank 0; one token per sequence, k = 1.
    rank0 = local([[1], [3]], [[True], [True]], 5, [[1.0], [3.0]])
    rank1 = local([[0], [2]], [[True], [False]], 7, [[0.0], [2.0]])
    (experts, _, kept), capacity, rows = distributed._assemble([rank0, rank1], [[1, 3], [0, 2]], 4, 1)
    assert experts[:, 0].tolist() == [0, 1, 2, 3]
    assert kept[:, 0].tolist() == [True, True, False, True]
    assert capacity == {"scope": "rank", "slots": [5, 7]}
    assert rows is not None and rows[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_ranks_that_disagree_are_an_error():
    good = local([[1]], [[True]], 5, [[1.0]])
    with pytest.raises(RuntimeError, match="ranks disagree on dropping"):
        distributed._assemble([good, local([[0]], [[True]], None, [[0.0]])], [[0], [1]], 2, 1)
    with pytest.raises(RuntimeError, match="rank 1 lacks output rows"):
        distributed._assemble([good, local([[0]], [[True]], 5, None)], [[0], [1]], 2, 1)
    with pytest.raises(RuntimeError, match=r"rank 1 answered routes of shape \(2, 1\), expected \(1, 1\)"):
        distributed._assemble([good, local([[0], [1]], [[True], [True]], 5, [[0.0], [0.0]])], [[0], [1]], 2, 1)


def test_a_layer_response_carries_its_placement_and_output_rows():
    routes = moe_audit.routes_from_arrays(np.array([[0, 1], [1, 0]]), np.full((2, 2), 0.5))
    output = np.arange(6, dtype=np.float32).reshape(2, 3)
    header, payload = v2.response(4, routes.columns(), {"scope": "rank", "slots": [1, 2]}, 2, [1, 0], output)
    h = json.loads(header)
    assert h == {"id": 4, "routes": 4, "capacity": {"scope": "rank", "slots": [1, 2]}, "placement": [1, 0],
                 "bytes": 4 * 2 + 9 * 4 + 4 * 2 * 3}
    assert np.frombuffer(payload[-24:], dtype="<f4").tolist() == output.ravel().tolist()


def test_a_rank_scope_needs_ranks_and_one_count_each():
    with pytest.raises(ValueError, match="scope 'rank' is not"):
        v1.capacity_form({"scope": "rank", "slots": [1, 2]}, 4)
    with pytest.raises(ValueError, match=r"one slot count per rank \(3\)"):
        v1.capacity_form({"scope": "rank", "slots": [1, 2]}, 4, ranks=3)


# -- launches --------------------------------------------------------------------------------


class Launch:
    """A layer script under ``torch.distributed.run``, spoken to as moe-audit speaks to it."""

    def __init__(self, script, *args, ranks=2, env=None):
        package = os.path.dirname(os.path.dirname(moe_audit.__file__))
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join([package, os.environ.get("PYTHONPATH", "")]),
                           OMP_NUM_THREADS="1", **(env or {}))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   str(script), *args]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=environment, start_new_session=True)
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.stdin, self.stdout, self.stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        line = self.stdout.readline()
        self.handshake = json.loads(line) if line else None

    def call(self, data, placement=None, mode="train", request_id=1):
        """(header, experts [T, k], weights, kept, output rows [T, H]) of one call."""
        b, s, h = data.shape
        header = {"id": request_id, "mode": mode, "batch": b, "seq_len": s, "width": h, "seed": 0,
                  "padding": False, "bytes": data.nbytes}
        if placement is not None:
            header["placement"] = placement
        self.stdin.write(json.dumps(header).encode() + b"\n" + data.astype("<f4").tobytes())
        self.stdin.flush()
        line = self.stdout.readline()
        if not line:
            return None
        r = json.loads(line)
        payload = self.stdout.read(r["bytes"])
        t, n = b * s, r["routes"]
        k = n // t
        experts = np.frombuffer(payload, "<i4", n, 4 * t).reshape(t, k)
        weights = np.frombuffer(payload, "<f4", n, 4 * t + 4 * n).reshape(t, k)
        kept = np.frombuffer(payload, np.uint8, n, 4 * t + 8 * n).reshape(t, k).astype(bool)
        rows = np.frombuffer(payload, "<f4", t * h, 4 * t + 9 * n).reshape(t, h)
        return r, experts, weights, kept, rows

    def close(self, timeout=60):
        """(exit code, stderr) once the launch has ended."""
        if not self.stdin.closed:
            try:
                self.stdin.close()
            except BrokenPipeError:
                pass
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)
        return code, self.stderr.read().decode(errors="replace")


def batch(b=4, s=64, h=64, seed=0):
    return np.random.default_rng(seed).standard_normal((b, s, h)).astype(np.float32)


def fault_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith(distributed.FAULT)]


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="torch is not installed (pip install torch)")


def test_the_fake_layer_answers_per_rank_with_its_placement(torch):
    launch = Launch(FAKE)
    assert launch.handshake is not None
    assert launch.handshake["ranks"] == 2 and launch.handshake["output"] == "float32"
    data = batch(h=8, s=16)
    header, experts, _, kept, rows = launch.call(data)
    assert header["placement"] == [0, 0, 1, 1]  # contiguous by default
    assert header["capacity"] == {"scope": "rank", "slots": [16, 16]}  # ceil(32 tokens * 2 / 4)
    strided = launch.call(data, placement=[0, 1, 0, 1], request_id=2)
    assert strided[0]["placement"] == [0, 1, 0, 1]
    # Sequence 0 is first on rank 0 either way: the same routes and output; sequence 1 moved
    # from second on rank 0 to first on rank 1, where it competes with other tokens.
    assert (strided[1][:16] == experts[:16]).all() and (strided[4][:16] == rows[:16]).all()
    code, stderr = launch.close()
    assert code == 0, stderr


@pytest.mark.parametrize("fault", ["raise", "exit", "hang"])
def test_a_rank_that_fails_is_named_and_the_launch_ends(torch, fault):
    started = time.monotonic()
    launch = Launch(FAKE, env={"FAULT": fault, "MOE_AUDIT_TIMEOUT": "5"})
    data = batch(h=8, s=8)
    assert launch.call(data) is not None
    assert launch.call(data, request_id=2) is None  # the launch ended instead of answering
    code, stderr = launch.close()
    assert code != 0
    lines = fault_lines(stderr)
    assert lines, stderr[-2000:]
    if fault == "raise":
        # Rank 1's own line, or rank 0's naming rank 1's failure as it recorded it.
        assert lines[-1].startswith(("moe-audit: rank 1: RuntimeError: injected failure",
                                     "moe-audit: rank 0:")), lines
        assert "rank 1" in lines[-1] and "RuntimeError: injected failure" in lines[-1], lines
    else:
        expected = "moe-audit: rank 0: call 2 not done within 4 s; waiting on " if fault == "hang" else \
            "moe-audit: rank 0:"
        assert lines[-1].startswith(expected), lines
        assert "rank 1 (2:received)" in lines[-1], lines
    assert time.monotonic() - started < 45


def test_a_world_the_layer_does_not_divide_fails_before_the_handshake(torch):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")
    launch = Launch(EXAMPLES / "ep_megatron.py", "--ep", "2", ranks=3)
    assert launch.handshake is None
    code, stderr = launch.close()
    assert code != 0
    lines = fault_lines(stderr)
    assert lines and "not divisible" in lines[-1], stderr[-2000:]


def gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def seeded_experts(experts, shapes, seed=0, std=0.02):
    """The weights seed_experts gives global expert e: its parameters (sorted by name) drawn in
    turn from a generator seeded with seed * 1_000_003 + e + 1, and the gate from seed."""
    import torch

    out = []
    for e in range(experts):
        g = torch.Generator().manual_seed(seed * 1_000_003 + e + 1)
        out.append([(torch.randn(shape, generator=g) * std).numpy() for shape in shapes])
    return out


def gate_weight(shape, seed=0, std=0.02):
    import torch

    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std).numpy()


def check_output(data, experts, weights, kept, rows, params):
    """The layer's rows equal the sum over kept routes of weight * fc2(gelu(fc1(x)))."""
    x = data.reshape(-1, data.shape[-1]).astype(np.float64)
    expected = np.zeros_like(x)
    for j in range(experts.shape[1]):
        for e in np.unique(experts[:, j]):
            on = (experts[:, j] == e) & kept[:, j]
            fc1, fc2 = params[e]
            expected[on] += weights[on, j, None] * (gelu(x[on] @ fc1.T.astype(np.float64)) @ fc2.T.astype(np.float64))
    assert np.abs(rows - expected).max() <= 1e-5 * max(1.0, np.abs(expected).max())


def capacity_holds(experts, kept, placement, seq_len, capacity):
    """No expert keeps more routes from a rank's tokens than that rank's slots."""
    for rank, slots in enumerate(capacity["slots"]):
        tokens = np.concatenate([np.arange(b * seq_len, (b + 1) * seq_len)
                                 for b, r in enumerate(placement) if r == rank])
        counts = np.bincount(experts[tokens][kept[tokens]], minlength=8)
        assert counts.max() <= slots


def framework(name):
    pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
    module = {"megatron": "megatron.core", "deepspeed": "deepspeed"}[name]
    pytest.importorskip(module, reason=f"{module} is not installed (pip install {name})")


@pytest.mark.parametrize("name", ["megatron", "deepspeed"])
def test_a_framework_layer_over_two_ranks_drops_per_rank(name):
    framework(name)
    launch = Launch(EXAMPLES / f"ep_{name}.py")
    hs = launch.handshake
    assert hs is not None, launch.close()[1][-3000:]
    assert (hs["ranks"], hs["output"], hs["experts"], hs["top_k"], hs["hidden_size"]) == (2, "float32", 8, 2, 64)
    data = batch(b=4, s=64)
    contiguous = launch.call(data)
    strided = launch.call(data, placement=[0, 1, 0, 1], request_id=2)
    code, stderr = launch.close()
    assert code == 0, stderr[-3000:]
    params = seeded_experts(8, [(128, 64), (64, 128)])
    assert hs["weights"] == distributed.fingerprint_of(
        [gate_weight((8, 64)).tobytes()] + [b"".join(p.tobytes() for p in e) for e in params])
    for (header, experts, weights, kept, rows), placement in ((contiguous, [0, 0, 1, 1]), (strided, [0, 1, 0, 1])):
        assert header["placement"] == placement
        # 128 tokens a rank, top-2 of 8 experts, capacity factor 1: Megatron ceil(128 * 2 / 8),
        # DeepSpeed max(ceil(128 / 8 * 1 * 2), min_capacity 4): 32 slots per expert and rank.
        assert header["capacity"] == {"scope": "rank", "slots": [32, 32]}
        capacity_holds(experts, kept, placement, 64, header["capacity"])
        assert not kept.all()
        check_output(data, experts, weights, kept, rows, params)
    # Which sequences share a rank decides who is dropped.
    assert (contiguous[3] != strided[3]).any()
