"""Random draws keyed per token by the token's own input row: ``seed_calls=True`` of
:class:`moe_audit.hf.Router`.

A router with training-time randomness (Mixtral, Switch, DBRX and MiniMax jitter, PhiMoE's
sparsemixer sampling, NLLB-MoE's sampled second experts) draws fresh noise on every call: the D
probe reports it, and every other probe's differences are noise. Seeding torch with the request's
seed before each call makes the same call draw the same noise, but it keys the noise on the
call's *shape*: the generator fills the random tensor in order, so the noise a token gets is
fixed by its flat position in the call. Change the prefix, the batch or the layout (the P, R and L
probes) and every token shifts to other noise: a seeded Mixtral block with jitter 0.1 showed
"leaks" on P (50%), R (43%) and L (50%), PhiMoE on P, R and L (4-8%), and the audit cannot tell
that apart from a router whose routing really depends on other tokens.

Here every draw is made per token instead, from a generator keyed on ``(seed, the token's input
row)``: ``blake2b`` of the request's seed and the bytes of ``data[b, s, :]`` (float32). A
token's noise is then a function of the token alone, so two calls in which a token has the same
input give it the same noise wherever it sits (another prefix, batch, padding, order or layout),
and the probes see the router's own dependence on other tokens, not the noise's. A real leak
(NLLB-MoE's per-call capacity) still shows: the seeding only removes the noise's dependence on
the rest of the call. Tokens with identical rows draw identical noise (their noise is not
independent; for an audit that is the point). The same call twice draws the same noise (D
passes); the training rule still differs from inference (M compares a jittered call with an
unjittered one, which is a real train/serve difference).

:class:`PerToken` is a ``torch.overrides.TorchFunctionMode`` active only during the wrapped call.
It intercepts the random ops transformers MoE blocks use (``Tensor.uniform_`` / ``normal_`` /
``exponential_`` / ``bernoulli_`` / ``random_`` / ..., ``torch.rand`` / ``randn`` /
``rand_like`` / ``randn_like`` / ``randint`` / ``randint_like`` / ``bernoulli`` /
``multinomial`` / ``normal`` / ``poisson`` / ``binomial``, the gamma and Dirichlet samplers
``torch.distributions`` use, ``F.dropout`` and ``F.gumbel_softmax``) and fills each token's slice
of the random tensor from that token's generator (one stream per token and call: its k-th draw in
a call is the same whatever else the call holds). The token of a slice is read from the random
tensor's shape: leading dimensions ``(batch, seq_len)`` (index ``[b, s]``) or the flattened
tokens ``batch * seq_len`` (index ``[b * seq_len + s]``, the order of ``view(-1, hidden)``); a
multinomial's token is its probability row's. A draw whose shape is neither (a scalar such as
LayerDrop's ``torch.rand([])``, a permutation, noise for a subset of the tokens) cannot be
attributed to a token and raises :class:`NotKeyed`, naming the op and the shape, rather than
falling back to noise keyed on the call's shape. A random op this module does not know would draw
from torch's global generator: the global CPU (and initialised CUDA) generator state is compared
before and after the call, and a change raises :class:`NotKeyed` too. (A block of another process
or thread drawing from the global generator at the same time would trip that check as well.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Callable, NoReturn

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import MoeAuditError

#: A torch function or method, as __torch_function__ gets it.
Op = Callable[..., Any]
#: ``draw(token's slice, its index, its generator)``: fills the slice.
Draw = Callable[[torch.Tensor, Any, torch.Generator], Any]
#: ``fill(slice, generator)``: fills a token's slice of a fresh tensor.
Fill = Callable[[torch.Tensor, torch.Generator], Any]


class NotKeyed(MoeAuditError, RuntimeError):
    """A random draw of a seeded call that cannot be keyed per token."""


#: What every NotKeyed message offers instead.
_INSTEAD = ("audit it unseeded (seed_calls=False: the D probe reports the randomness) or with "
            "--mode inference")


def token_keys(seed: int, data: Any) -> list[int]:
    """The generator seed of every token of ``data`` [batch, seq_len, hidden], in flat order:
    ``blake2b`` (8 bytes, keyed by the seed) of the token's float32 row."""
    rows = np.ascontiguousarray(data, dtype=np.float32)
    rows = rows.reshape(rows.shape[0] * rows.shape[1], -1)
    key = int(seed).to_bytes(16, "little", signed=True)
    return [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8, key=key).digest(), "little")
            for row in rows]


def _arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    """The argument at this position, else this keyword, else the default."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


class PerToken(TorchFunctionMode):
    """``with PerToken(seed, data): block(x)``: every random draw of the block is made per token,
    from a generator keyed on the seed and the token's row of ``data`` [batch, seq_len, hidden]
    (see the module docstring)."""

    def __init__(self, seed: int, data: Any) -> None:
        super().__init__()
        shape = np.shape(data)
        self.batch, self.seq_len = int(shape[0]), int(shape[1])
        self.tokens = self.batch * self.seq_len
        self.keys = token_keys(seed, data)
        self._generators: dict[tuple[int, torch.device], torch.Generator] = {}
        self._flat: list[tuple[int, ...]] = [(t,) for t in range(self.tokens)]
        self._nested: list[tuple[int, ...]] = [(b, s) for b in range(self.batch) for s in range(self.seq_len)]
        self._global: list[torch.Tensor] = []

    # -- the context ------------------------------------------------------------------------

    def __enter__(self) -> PerToken:
        self._generators = {}
        self._global = _global_state()
        super().__enter__()  # type: ignore[no-untyped-call, unused-ignore]  # torch leaves it unannotated
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        super().__exit__(kind, value, traceback)  # type: ignore[no-untyped-call, unused-ignore]  # as __enter__
        if kind is None and not _same(self._global, _global_state()):
            raise NotKeyed(
                "seed_calls: the block drew random numbers from torch's global generator through an op "
                f"that moe_audit.hf.seeded does not intercept, so seed_calls cannot key it per token; {_INSTEAD}")

    # -- tokens -------------------------------------------------------------------------------

    def slices(self, shape: Sequence[int], op: str) -> list[tuple[int, ...]]:
        """Each token's index into a tensor of this shape, in flat token order."""
        shape = tuple(shape)
        if len(shape) >= 2 and shape[:2] == (self.batch, self.seq_len):
            return self._nested
        if len(shape) >= 1 and shape[0] == self.tokens:
            return self._flat
        self.unkeyed(op, shape)

    def unkeyed(self, op: str, shape: Sequence[int]) -> NoReturn:
        """Raises :class:`NotKeyed` for a draw of this shape."""
        raise NotKeyed(
            f"seed_calls: {op} draws random numbers of shape {list(shape)}, which cannot be attributed "
            f"to the call's tokens (leading dimensions [{self.batch}, {self.seq_len}], batch and seq_len, or "
            f"[{self.tokens}], the tokens flattened): "
            f"seed_calls keys every draw per token by the token's own input and cannot key this one; {_INSTEAD}")

    def generator(self, t: int, device: torch.device | str) -> torch.Generator:
        """Token t's generator on device (one stream per token and call)."""
        device = torch.device(device)
        g = self._generators.get((t, device))
        if g is None:
            g = torch.Generator(device=device).manual_seed(self.keys[t])
            self._generators[(t, device)] = g
        return g

    def fill(self, out: torch.Tensor, op: str, draw: Draw) -> torch.Tensor:
        """``draw(token_slice, token_index, generator)`` for every token's slice of out."""
        with torch.no_grad():
            for t, index in enumerate(self.slices(out.shape, op)):
                draw(out[index], index, self.generator(t, out.device))
        return out

    # -- the ops ------------------------------------------------------------------------------

    def __torch_function__(self, func: Op, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self, func, args, kwargs)
        if func in _UNKEYED:
            return _watched(self, func, args, kwargs)
        return func(*args, **kwargs)


def _name(func: Op) -> str:
    return _NAMES.get(func) or str(getattr(func, "__name__", repr(func)))


def _fill_in_place(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # Tensor.uniform_(from, to), normal_(mean, std), exponential_(lambd), random_(from, to), ...
    target, rest = args[0], args[1:]
    kwargs.pop("generator", None)
    return mode.fill(target, _name(func), lambda part, i, g: func(part, *rest, generator=g, **kwargs))


def _fill_bernoulli(mode: PerToken, out: torch.Tensor, op: str, p: Any) -> torch.Tensor:
    """out filled per token with Bernoulli draws of probability p: a number, or a tensor
    broadcast to out's shape."""
    if isinstance(p, torch.Tensor):
        p = torch.broadcast_to(p, out.shape)
        return mode.fill(out, op, lambda part, i, g: part.bernoulli_(p[i], generator=g))
    return mode.fill(out, op, lambda part, i, g: part.bernoulli_(p, generator=g))


def _bernoulli_(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return _fill_bernoulli(mode, args[0], _name(func), _arg(args, kwargs, 1, "p", 0.5))


def _drawn(mode: PerToken, func: Op, out: torch.Tensor, kwargs: dict[str, Any], draw: Fill) -> torch.Tensor:
    """A fresh tensor out filled per token by ``draw(part, generator)``, requiring grad if the
    call asked (``requires_grad``, popped from kwargs before out was made)."""
    mode.fill(out, _name(func), lambda part, i, g: draw(part, g))
    return out.requires_grad_(True) if kwargs.get("requires_grad") else out


def _options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs without the generator (each token has its own) and requires_grad (set after the
    fill), for making the empty tensor."""
    return {k: v for k, v in kwargs.items() if k not in ("generator", "requires_grad")}


#: What handles an op: ``handler(mode, func, args, kwargs)``.
Handler = Callable[[PerToken, Op, Sequence[Any], dict[str, Any]], Any]


def _factory(fill: Fill, empty: Callable[..., torch.Tensor] = torch.empty) -> Handler:
    # torch.rand(*size, ...) -> torch.empty(*size, ...) filled per token; with empty=torch.empty_like,
    # torch.rand_like(input, ...) likewise.
    def handle(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        return _drawn(mode, func, empty(*args, **_options(kwargs)), kwargs, fill)
    return handle


def _like(fill: Fill) -> Handler:
    return _factory(fill, torch.empty_like)


def _low_high(numbers: list[Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(low, high) of randint's numbers: (high), (low, high), or low/high keywords (popped)."""
    if "high" in kwargs:
        return kwargs.pop("low", numbers[0] if numbers else 0), kwargs.pop("high")
    if len(numbers) == 2:
        return tuple(numbers)
    return kwargs.pop("low", 0), numbers[0]


def _randint(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # randint(high, size) or randint(low, high, size), low/high/size also as keywords.
    args = list(args)
    size = kwargs.pop("size") if "size" in kwargs else args.pop()
    low, high = _low_high(args, kwargs)
    kwargs.setdefault("dtype", torch.int64)
    return _drawn(mode, func, torch.empty(size, **_options(kwargs)), kwargs,
                  lambda part, g: part.random_(low, high, generator=g))


def _randint_like(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # randint_like(input, high) or randint_like(input, low, high).
    low, high = _low_high(list(args[1:]), kwargs)
    return _drawn(mode, func, torch.empty_like(args[0], **_options(kwargs)), kwargs,
                  lambda part, g: part.random_(low, high, generator=g))


def _bernoulli(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # torch.bernoulli(input) (input the probabilities), torch.bernoulli(input, p), Tensor.bernoulli.
    source = args[0]
    p = _arg(args, kwargs, 1, "p")
    out = kwargs.get("out")
    out = torch.empty_like(source) if out is None else out
    return _fill_bernoulli(mode, out, _name(func), source if p is None else p)


def _multinomial(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # One draw per probability row: the token is the row's.
    source, rest = args[0], args[1:]
    kwargs.pop("generator", None)
    out = kwargs.pop("out", None)
    if source.dim() != 2:
        mode.unkeyed(_name(func), list(source.shape[:-1]) + list(rest[:1]))  # one distribution: no token's
    rows = [func(source[index], *rest, generator=mode.generator(t, source.device), **kwargs)
            for t, index in enumerate(mode.slices(source.shape, _name(func)))]
    result = torch.stack(rows)
    return result if out is None else out.copy_(result)


def _normal(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # torch.normal(mean, std[, size]): mean and std tensors or numbers.
    kwargs.pop("generator", None)
    mean = _arg(args, kwargs, 0, "mean", 0.0)
    std = _arg(args, kwargs, 1, "std", 1.0)
    size = _arg(args, kwargs, 2, "size")
    tensors = [a for a in (mean, std) if isinstance(a, torch.Tensor)]
    out = kwargs.get("out")
    if out is None:
        if size is not None:
            options = {k: kwargs[k] for k in ("dtype", "layout", "device", "pin_memory") if k in kwargs}
            out = torch.empty(size, **options)
        else:
            shape = torch.broadcast_shapes(*(a.shape for a in tensors))
            out = torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device)
    mode.fill(out, _name(func), lambda part, i, g: part.normal_(generator=g))
    with torch.no_grad():
        out.mul_(std).add_(mean)
    if kwargs.get("requires_grad"):
        out.requires_grad_(True)
    return out


def _elementwise(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # poisson(rates), binomial(count, prob), _standard_gamma(alpha), _sample_dirichlet(alpha):
    # the sampler run on each token's slice of its (broadcast) tensor arguments.
    kwargs.pop("generator", None)
    out = kwargs.pop("out", None)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    shape = torch.broadcast_shapes(*(a.shape for a in tensors))
    full = [torch.broadcast_to(a, shape) if isinstance(a, torch.Tensor) else a for a in args]
    result = torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device) if out is None else out

    def draw(part: torch.Tensor, index: Any, g: torch.Generator) -> None:
        part.copy_(func(*(a[index] if isinstance(a, torch.Tensor) else a for a in full), generator=g, **kwargs))

    return mode.fill(result, _name(func), draw)


def _dropout(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # F.dropout(input, p=0.5, training=True, inplace=False); torch.dropout(_)(input, p, train):
    # each token's keep mask from its own generator.
    source = _arg(args, kwargs, 0, "input")
    p = _arg(args, kwargs, 1, "p", 0.5)
    training = _arg(args, kwargs, 2, "training" if func is F.dropout else "train", True)
    if func is F.dropout:
        inplace = bool(_arg(args, kwargs, 3, "inplace", False))
    else:
        inplace = func is getattr(torch, "dropout_", None)
    if not training or p == 0:
        return func(*args, **kwargs)
    if p == 1:
        return source.mul_(0) if inplace else source * 0
    keep = _fill_bernoulli(mode, torch.empty_like(source), _name(func), 1 - p)
    keep.div_(1 - p)
    return source.mul_(keep) if inplace else source * keep


def _gumbel_softmax(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # F.gumbel_softmax(logits, tau=1, hard=False, eps=1e-10, dim=-1), its Gumbel noise per token.
    logits = _arg(args, kwargs, 0, "logits")
    tau = _arg(args, kwargs, 1, "tau", 1)
    hard = _arg(args, kwargs, 2, "hard", False)
    dim = _arg(args, kwargs, 4, "dim", -1)
    noise = mode.fill(torch.empty_like(logits, memory_format=torch.legacy_contiguous_format), _name(func),
                      lambda part, i, g: part.exponential_(generator=g))
    soft = ((logits - noise.log()) / tau).softmax(dim)
    if not hard:
        return soft
    index = soft.max(dim, keepdim=True)[1]
    one_hot = torch.zeros_like(logits, memory_format=torch.legacy_contiguous_format).scatter_(dim, index, 1.0)
    return one_hot - soft.detach() + soft


def _watched(mode: PerToken, func: Op, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # Random ops drawn whole (permutations, channel dropout, rrelu): if the call drew, it cannot be
    # keyed per token.
    before = _global_state()
    result = func(*args, **kwargs)
    if not _same(before, _global_state()):
        shape = list(result.shape) if isinstance(result, torch.Tensor) else "?"
        raise NotKeyed(
            f"seed_calls: {_name(func)} draws random numbers (shape {shape}) as a whole, which seed_calls "
            f"cannot key per token by each token's own input; {_INSTEAD}")
    return result


def _global_state() -> list[torch.Tensor]:
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.extend(torch.cuda.get_rng_state_all())
    return states


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


_NAMES: dict[Op, str] = {}


def _ops(owner: Any, prefix: str, names: list[str]) -> list[Op]:
    """The ops of owner with these names (those this torch has), named for error messages."""
    found = []
    for n in names:
        op = getattr(owner, n, None)
        if op is not None:
            _NAMES.setdefault(op, f"{prefix}.{n}")
            found.append(op)
    return found


_HANDLERS: dict[Op, Handler] = {}
for _op in _ops(torch.Tensor, "Tensor", ["uniform_", "normal_", "exponential_", "geometric_", "log_normal_",
                                         "cauchy_", "random_"]):
    _HANDLERS[_op] = _fill_in_place
for _op in _ops(torch.Tensor, "Tensor", ["bernoulli_"]):
    _HANDLERS[_op] = _bernoulli_
_FILLS: dict[str, Fill] = {
    "rand": lambda part, g: part.uniform_(generator=g),
    "randn": lambda part, g: part.normal_(generator=g),
}
for _n, _fill in _FILLS.items():
    for _op in _ops(torch, "torch", [_n]):
        _HANDLERS[_op] = _factory(_fill)
    for _op in _ops(torch, "torch", [_n + "_like"]):
        _HANDLERS[_op] = _like(_fill)
for _op in _ops(torch, "torch", ["randint"]):
    _HANDLERS[_op] = _randint
for _op in _ops(torch, "torch", ["randint_like"]):
    _HANDLERS[_op] = _randint_like
for _op in _ops(torch, "torch", ["bernoulli"]) + _ops(torch.Tensor, "Tensor", ["bernoulli"]):
    _HANDLERS[_op] = _bernoulli
for _op in _ops(torch, "torch", ["multinomial"]) + _ops(torch.Tensor, "Tensor", ["multinomial"]):
    _HANDLERS[_op] = _multinomial
for _op in _ops(torch, "torch", ["normal"]):
    _HANDLERS[_op] = _normal
for _op in _ops(torch, "torch", ["poisson", "binomial", "_standard_gamma", "_sample_dirichlet"]):
    _HANDLERS[_op] = _elementwise
for _op in _ops(torch, "torch", ["dropout", "dropout_"]) + _ops(F, "torch.nn.functional", ["dropout"]):
    _HANDLERS[_op] = _dropout
for _op in _ops(F, "torch.nn.functional", ["gumbel_softmax"]):
    _HANDLERS[_op] = _gumbel_softmax

# Drawn as a whole (a permutation, whole channels, rrelu's slopes): raise if they draw in the call.
_UNKEYED = set(_ops(torch, "torch", ["randperm", "alpha_dropout", "alpha_dropout_", "feature_dropout",
                                     "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_",
                                     "native_dropout", "rrelu", "rrelu_"])
               + _ops(F, "torch.nn.functional", ["alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
                                                 "dropout3d", "rrelu", "rrelu_"]))
