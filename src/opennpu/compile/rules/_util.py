"""Helpers shared by the rule modules: example inputs and the checks on matched values."""

from __future__ import annotations

import inspect
import operator

import torch
from torch._inductor.pattern_matcher import Match

from ..rule_registry import training

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def val(match: Match, name: str):
    """The fake value (tensor, SymInt or Python scalar) bound to pattern argument `name`."""
    arg = match.kwargs[name]
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def same_float_dtype(*tensors) -> bool:
    """All tensors share one of fp32/fp16/bf16 (the fused ops' dtypes; no mixed promotion)."""
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    return tensors[0].dtype in FLOAT_DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)


def is_last_dim_vector(weight, x) -> bool:
    """`weight` is 1-D with x's last size (a per-channel scale over the normalised axis)."""
    return (isinstance(weight, torch.Tensor) and isinstance(x, torch.Tensor) and weight.dim() == 1
            and x.dim() >= 1 and torch.fx.experimental.symbolic_shapes.statically_known_true(
                weight.shape[0] == x.shape[-1]))


def drop_eps(fn):
    """`fn` without its last parameter `eps` (passed as None): the pattern without epsilon."""
    sig = inspect.signature(fn)

    def without_eps(*args):
        return fn(*args, None)

    without_eps.__signature__ = sig.replace(parameters=list(sig.parameters.values())[:-1])
    without_eps.__name__ = f"{fn.__name__}_default_eps"
    return without_eps


def call_eps(op, *args, eps):
    """op(*args, eps), or op(*args) when eps is None (the default-epsilon spelling)."""
    return op(*args) if eps is None else op(*args, eps)


def size_hint(size) -> int | None:
    """A size's value in the example the graph was traced with (None if unknown): speed gates are
    heuristics, so a graph compiled under dynamic shapes keeps the choice made for it."""
    if isinstance(size, int):
        return size
    return getattr(getattr(size, "node", None), "hint", None)


# Speed gate of the norm and rotary rules: in graphs that will not be differentiated, fewer
# tokens than this stay with Inductor. Our kernels then run no faster than Inductor's fused loops
# (perf, bf16 Llama layer, S=64: 0.11 ms per call for either), and each custom op costs a fixed
# ~50 us more per call (the Python autograd wrapper of torch.library.register_autograd, which
# runs under no_grad too, the dispatcher, the output tensors): one thread, bf16 forward, the layer
# measured 0.90-0.93x torch.compile at S=64 and 0.95-1.00x at S=256 with the two rules, 0.99-1.04x
# without; from 512 tokens on they are neutral or better, and in training they help.
INFERENCE_MIN_TOKENS = 512


def worth_fusing(tokens) -> bool:
    """The norm/rotary speed gate for a match over `tokens` rows (a size, SymInt or None)."""
    if training():
        return True
    hint = size_hint(tokens)
    return hint is None or hint >= INFERENCE_MIN_TOKENS


def known(condition) -> bool:
    """`condition` (a bool or a SymBool over the compile's symbolic sizes) holds for every size
    the compiled graph may see; unknown counts as False, so a dynamic graph is never fused on a
    guess."""
    return torch.fx.experimental.symbolic_shapes.statically_known_true(condition)


def bsnd_in_memory(t: torch.Tensor) -> bool:
    """t [B, N, S, D] is t'.transpose(1, 2) for a contiguous t' [B, S, N, D] (sizes 1 ignored):
    transformers' q, k and v, projected as [B, S, N * D] and viewed BNSD."""
    if t.dim() != 4:
        return False
    b, n, s, d = t.shape
    sb, sn, ss, sd = t.stride()
    return (known(sd == 1) or known(d == 1)) and (known(sn == d) or known(n == 1)) and \
        (known(ss == n * d) or known(s == 1)) and (known(sb == s * n * d) or known(b == 1))


def known_same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b have one shape for every size the compiled graph may see."""
    return a.dim() == b.dim() and all(known(x == y) for x, y in zip(a.shape, b.shape))


def known_contiguous(t: torch.Tensor) -> bool:
    """t is contiguous for every size the compiled graph may see (size-1 dims ignored)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not (known(size == 1) or known(stride == expected)):
            return False
        expected = expected * size
    return True


def nodes(match: Match, *targets) -> list[torch.fx.Node]:
    """The matched nodes calling one of `targets`, in graph order."""
    return [n for n in match.nodes if n.op == "call_function" and n.target in targets]


def arg(node: torch.fx.Node, index: int, default=None):
    """Positional argument `index` of `node` (int, float, SymInt from node.meta, or `default` when
    the dispatcher dropped it), as pattern wildcards leave it to extra_check."""
    value = node.args[index] if index < len(node.args) else default
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else value


def is_last_dim(dim, rank: int) -> bool:
    """`dim` (as a graph argument: int, maybe negative) names the last of `rank` dims."""
    return isinstance(dim, int) and rank >= 1 and dim in (-1, rank - 1)


def broadcasts_into(small, big) -> bool:
    """`small` broadcasts to `big`'s shape without changing it (no new dims, no size > 1 against
    a size of `big`): `small op big` then has exactly `big`'s shape, as the fused ops' output."""
    if not (isinstance(small, torch.Tensor) and isinstance(big, torch.Tensor)):
        return False
    if small.dim() > big.dim():
        return False
    return all(known(s == 1) or known(s == b)
               for s, b in zip(reversed(small.shape), reversed(big.shape)))


_SLICE_END = 2**63 - 1  # what `x[..., n:]` passes as the slice end (sys.maxsize)


def is_chunk_in_halves(chunk: torch.fx.Node, x) -> bool:
    """aten.chunk.default(x, 2, dim) along x's last dim D: its halves when D is even (for an odd
    D chunk makes the first part the larger; the caller checks D with `guard_even`)."""
    return arg(chunk, 1) == 2 and is_last_dim(arg(chunk, 2, 0), x.dim())


def halves_of_last_dim(first, second, x) -> bool:
    """`first` and `second` are aten.slice.Tensor(x, dim, start, end[, step]) nodes taking
    [0, n) and [n, D) of x's last dim D with n = D // 2, as ``x[..., :n]`` / ``x[..., n:]`` do:
    the halves when D is even (the caller checks D with `guard_even`). Their arguments are
    pattern wildcards (ints, or SymInts under dynamic shapes), so every one is checked; the
    second's end may be anything >= D (Python's ``n:`` passes maxsize)."""
    slice_op = torch.ops.aten.slice.Tensor
    if not (isinstance(first, torch.fx.Node) and isinstance(second, torch.fx.Node)
            and first.target is slice_op and second.target is slice_op):
        return False
    for node in (first, second):
        if not (is_last_dim(arg(node, 1, 0), x.dim()) and arg(node, 4, 1) == 1):
            return False
    size = x.shape[-1]
    start1, end1 = arg(first, 2, 0), arg(first, 3, _SLICE_END)
    start2, end2 = arg(second, 2, 0), arg(second, 3, _SLICE_END)
    start1 = 0 if start1 is None else start1
    end2 = _SLICE_END if end2 is None else end2
    if end1 is None or start2 is None:
        return False
    # maxsize is "to the end" (sympy cannot prove maxsize >= s for an unbounded size s).
    to_end = (isinstance(end2, int) and end2 == _SLICE_END) or known(end2 >= size)
    return known(start1 == 0) and known(end1 == size // 2) and known(start2 == end1) and to_end


def guard_even(size) -> bool:
    """Whether `size` is even, specialising a dynamic graph on that fact when it is not known.

    bool() of a SymBool installs a Dynamo guard (as Inductor's own size checks do), so the
    compiled graph only runs for sizes of the same parity: an odd size later recompiles, and the
    rule then leaves that graph alone. Call it last in an extra_check, once everything else
    matched, so graphs that are not fused are not specialised."""
    return known(size % 2 == 0) or bool(size % 2 == 0)


# An op runs on npu exactly where it has a CPU kernel: npu's boxed fallback runs the CPU kernel on
# the npu tensors' host memory (csrc/device/npu_fallback.cpp), fused ops included.
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "npu": "CPU"}


def has_kernels(ops, *tensors) -> bool:
    """Every op named in `ops` (a fused op and its backward; `torch.ops.npu` names, or qualified
    ones such as "opennpu::_silu_mul") has a kernel for the device of `tensors` (one device). The
    ops are registered per device as their kernels land, so a rule must not put a CPU-only op
    into a CUDA graph, where the native code ran."""
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)) not in _DISPATCH_KEYS:
        return False
    key = _DISPATCH_KEYS[devices.pop()]
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(
        op if "::" in op else f"npu::{op}", key) for op in ops)


def number_or_absent(match: Match, name: str) -> bool:
    """Pattern argument `name` (a scalar_workaround float such as eps or scale) is absent or a
    Python number. The pattern's KeywordArg also matches a graph node (``x + eps_tensor``),
    which a fused op's float argument cannot take."""
    if name not in match.kwargs:
        return True
    value = match.kwargs[name]
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _aliased_source(node: torch.fx.Node):
    """For a node whose result may share memory with one of its inputs, that input (or False when
    the op may alias something this walk cannot follow); None when the result is a buffer of
    its own. Aliasing ops: every op whose schema says so (views: view, reshape, slice, permute,
    alias, detach...), and the ops Inductor's remove_noop_ops may replace by their input after
    the post-grad rules ran (clone, a same-dtype convert_element_type, a full slice...)."""
    from torch._inductor.fx_passes.post_grad import noop_registry

    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    schema = target._schema
    aliased = [r for r in schema.returns if r.alias_info is not None]
    if target in noop_registry:
        _, src = noop_registry[target]
        return node.args[0] if src == 0 and node.args else False  # copy, cat...: not followed
    if not aliased:
        return None
    first = schema.arguments[0] if schema.arguments else None
    if (len(schema.returns) == 1 and first is not None and first.alias_info is not None
            and set(first.alias_info.before_set) == set(aliased[0].alias_info.before_set)
            and node.args):
        return node.args[0]  # a view of self
    return False


def overwritable(arg, user: torch.fx.Node, wrote_before=None) -> bool:
    """Whether `user` (a call_function node of a functional graph) may write into `arg`'s memory
    without any other part of the program seeing it: `arg` is the only path to a buffer the graph
    itself allocated (the output of a non-aliasing op, possibly through single-use views or
    no-ops), and `user` is the only reader of that path and takes `arg` once. So the buffer is
    no graph input or parameter, no graph output (which in a training forward graph also means
    not saved for backward), and nothing reads it, or any alias of it, after (or before) `user`.

    `wrote_before(node)`: users of `arg` itself that wrote their result into it in place
    earlier (the last in-place op's output is `arg`, so the ops reading that result are `arg`'s
    other users); they are done with it before `user` runs."""
    if not isinstance(arg, torch.fx.Node) or user not in arg.users:
        return False
    if any(u is not user and not (wrote_before is not None and wrote_before(u))
           for u in arg.users):
        return False
    uses = [a for a in (*user.args, *user.kwargs.values()) if a is arg]
    if len(uses) != 1:
        return False
    node = arg
    while True:
        if node.op != "call_function":
            return False  # placeholder (input, parameter, saved tensor, tangent), get_attr
        if node.target is operator.getitem:
            # one output of a multi-output op that returns new buffers (npu_add_rms_norm...)
            producer = node.args[0]
            return (isinstance(producer, torch.fx.Node) and producer.op == "call_function"
                    and isinstance(producer.target, torch._ops.OpOverload)
                    and _aliased_source(producer) is None)
        source = _aliased_source(node)
        if source is None:
            return True
        if not (isinstance(source, torch.fx.Node) and len(source.users) == 1):
            return False
        node = source
