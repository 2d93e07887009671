"""The bad and edge inputs of the sweep, derived from each op's valid call and its schema.

A Mutation rewrites the keyword arguments of a valid call (op_specs.py). Which mutations apply is
read off the schema: every tensor argument gets wrong dtypes, ranks and shapes, another device (meta, npu),
non-contiguous, stride-0 and overlapping views, NaN/inf and empty dims; every int argument the
int32 and int64 limits and past them; every int[] argument those values, a reversed and a
negative list; index tensors extreme, negative and non-monotone values in int32 and int64.

judge() gives the verdict of one call: an error must name the op and one of its arguments, and
a call the op accepts must match the reference computed on the same arguments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from opennpu.testing.tolerances import tolerance

from .op_specs import OpSpec, ShapeOnly

INT_EDGES = {
    "neg1": -1, "int32_max": 2**31 - 1, "int32_max+1": 2**31, "int32_min-1": -(2**31) - 1,
    "int64_max": 2**63 - 1, "int64_min": -(2**63), "past_int64": 2**63, "past_int64_neg": -(2**63) - 1,
}
INDEX_EDGES = {  # values written into index tensors (only those the dtype holds)
    "neg1": -1, "int32_max": 2**31 - 1, "int32_min": -(2**31), "int64_max": 2**63 - 1,
    "int64_min": -(2**63),
}
FLOAT_EDGES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "neg": -1.0,
               "zero": 0.0}


@dataclass(frozen=True)
class Mutation:
    label: str
    apply: Callable[[dict], dict]


def _kind(arg) -> str:
    """'tensor', 'tensor_list', 'int', 'int_list', 'float', 'str', 'bool', 'scalar' or 'other'."""
    t = arg.type
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.TensorType):
        return "tensor"
    if isinstance(t, torch.ListType):
        inner = t.getElementType()
        if isinstance(inner, torch.TensorType):
            return "tensor_list"
        if isinstance(inner, (torch.IntType, torch.SymIntType)):
            return "int_list"
        return "other"
    if isinstance(t, (torch.IntType, torch.SymIntType)):
        return "int"
    if isinstance(t, torch.FloatType):
        return "float"
    if isinstance(t, torch.StringType):
        return "str"
    if isinstance(t, torch.BoolType):
        return "bool"
    if isinstance(t, torch.NumberType):
        return "scalar"
    return "other"


def _with(name: str, fn) -> Callable[[dict], dict]:
    def apply(kw: dict) -> dict:
        out = dict(kw)
        out[name] = fn(kw[name]) if name in kw else fn(None)
        return out

    return apply


# ----------------------------------------------------------------------------- tensor rewrites


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view (every other element of the last dim)."""
    if t.dim() == 0:
        return t
    buf = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    buf[..., ::2] = t
    return buf[..., ::2]


def _stride0(t: torch.Tensor) -> torch.Tensor:
    """A broadcast view: dim 0 of stride 0 (every slice equals the first)."""
    return t[:1].expand_as(t)


def _overlapping(t: torch.Tensor) -> torch.Tensor:
    """A view whose rows overlap in memory (dim 0 advances by one element)."""
    rest = t[0].numel()
    base = t.reshape(-1)[: t.shape[0] - 1 + rest].clone()
    strides = (1, *t[0].contiguous().stride())
    return base.as_strided(t.shape, strides)


def _poison(value: float) -> Callable:
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return fn


def _resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = size
    if t.is_floating_point():
        return torch.randn(shape, dtype=t.dtype)
    return torch.zeros(shape, dtype=t.dtype)


def _tensor_mutations(name: str, t: torch.Tensor, is_index: bool) -> list[Mutation]:
    m = [
        Mutation(f"{name}:meta", _with(name, lambda v: v.to("meta"))),
        Mutation(f"{name}:npu", _with(name, lambda v: v.to("npu"))),
        Mutation(f"{name}:rank+1", _with(name, lambda v: v.unsqueeze(0))),
        Mutation(f"{name}:noncontiguous", _with(name, _strided_copy)),
    ]
    if t.dim() >= 1:
        m.append(Mutation(f"{name}:rank-1", _with(name, lambda v: v.reshape(-1)[0] if v.dim() == 1
                                                   else v.reshape(-1, *v.shape[2:]))))
        m.append(Mutation(f"{name}:last+1", _with(name, lambda v: _resized(v, -1, v.shape[-1] + 1))))
        for d in range(t.dim()):
            m.append(Mutation(f"{name}:empty_dim{d}", _with(name, lambda v, d=d: _resized(v, d, 0))))
        if t.shape[0] > 1:
            m.append(Mutation(f"{name}:stride0", _with(name, _stride0)))
            if t.numel() > 0:
                m.append(Mutation(f"{name}:overlapping", _with(name, _overlapping)))
    if is_index or not (t.is_floating_point() or t.dtype == torch.bool):
        m.append(Mutation(f"{name}:float32", _with(name, lambda v: v.float())))
        other = torch.int64 if t.dtype == torch.int32 else torch.int32
        m.append(Mutation(f"{name}:{str(other)[6:]}", _with(name, lambda v: v.to(other))))
        m.append(Mutation(f"{name}:reversed", _with(name, lambda v: v.flip(-1))))
        for label, value in INDEX_EDGES.items():
            for dtype in (torch.int32, torch.int64):
                info = torch.iinfo(dtype)
                if info.min <= value <= info.max:
                    m.append(Mutation(f"{name}:{str(dtype)[6:]}={label}",
                                      _with(name, lambda v, x=value, dt=dtype:
                                            _poison(x)(v.to(dt)))))
    elif t.dtype == torch.bool:
        m.append(Mutation(f"{name}:float32", _with(name, lambda v: v.float())))
        m.append(Mutation(f"{name}:uint8", _with(name, lambda v: v.to(torch.uint8))))
    else:
        for dtype in (torch.int32, torch.bool, torch.float64, torch.float16, torch.bfloat16):
            m.append(Mutation(f"{name}:{str(dtype)[6:]}", _with(name, lambda v, dt=dtype: v.to(dt))))
        for label in ("nan", "inf", "-inf"):
            m.append(Mutation(f"{name}:{label}", _with(name, _poison(FLOAT_EDGES[label]))))
        # the largest finite float32 (overflows intermediate products) and a subnormal
        for label, value in (("max_float32", 3.4028234663852886e38), ("subnormal", 1e-45)):
            m.append(Mutation(f"{name}:{label}", _with(name, _poison(value))))
        if t.dim() >= 1:
            m.append(Mutation(f"{name}:0-dim", _with(name, lambda v: v.reshape(-1)[0].clone())))
    return m


def _list_mutations(name: str, ts: list) -> list[Mutation]:
    m = [Mutation(f"{name}:empty_list", _with(name, lambda v: [])),
         Mutation(f"{name}:extra", _with(name, lambda v: [*v, v[-1]]))]
    for i, t in enumerate(ts):
        for mut in _tensor_mutations(f"{name}[{i}]", t, is_index=False):
            def apply(kw, i=i, mut=mut):
                items = list(kw[name])
                items[i] = mut.apply({f"{name}[{i}]": items[i]})[f"{name}[{i}]"]
                return {**kw, name: items}
            m.append(Mutation(mut.label, apply))
    return m


def _all_on(device: str) -> Callable[[dict], dict]:
    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, list):
            return [move(t) for t in v]
        return v
    return lambda kw: {k: move(v) for k, v in kw.items()}


def mutations(spec: OpSpec) -> list[Mutation]:
    """Every bad or edge case of spec's valid call."""
    base = spec.build()
    out = [Mutation("all:npu", _all_on("npu"))]  # the valid call on the npu device
    for arg in spec.schema.arguments:
        name, kind = arg.name, _kind(arg)
        value = base.get(name)
        if kind == "tensor" and isinstance(value, torch.Tensor):
            out += _tensor_mutations(name, value, name in spec.index_args)
        elif kind == "tensor" and value is None and name in spec.index_args:
            continue
        elif kind == "tensor_list" and isinstance(value, list) and value:
            out += _list_mutations(name, value)
        elif kind == "int":
            for label, v in INT_EDGES.items():
                out.append(Mutation(f"{name}={label}", _with(name, lambda _, v=v: v)))
        elif kind == "int_list" and isinstance(value, (list, tuple)) and value:
            for label, v in INT_EDGES.items():
                out.append(Mutation(f"{name}[0]={label}",
                                    _with(name, lambda old, v=v: [v, *old[1:]])))
            out.append(Mutation(f"{name}:reversed", _with(name, lambda old: list(old)[::-1])))
            out.append(Mutation(f"{name}:empty_list", _with(name, lambda old: [])))
        elif kind == "int_list" and value is None:
            for label in ("neg1", "int64_max"):
                out.append(Mutation(f"{name}=[{label}]",
                                    _with(name, lambda _, v=INT_EDGES[label]: [v])))
        elif kind == "int_list" and isinstance(value, torch.Tensor):
            out += _tensor_mutations(name, value, True)
        elif kind in ("float", "scalar"):
            for label, v in FLOAT_EDGES.items():
                out.append(Mutation(f"{name}={label}", _with(name, lambda _, v=v: v)))
        elif kind == "str" and name in base:
            out.append(Mutation(f"{name}=bogus", _with(name, lambda _: "bogus")))
    return out


# ----------------------------------------------------------------------------- the verdict


def _arg_names(spec: OpSpec) -> list[str]:
    return [a.name for a in spec.schema.arguments]


def _allocation_refused(error: Exception) -> bool:
    """A valid call whose outputs need more memory than the child may take (its data limit,
    isolation.py) fails in the allocator, with the size it tried: a clear error, not a defect."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def named_error(spec: OpSpec, message: str) -> str | None:
    """None when the message names the op and one of its arguments, else what is missing."""
    op = spec.schema.name.split("::")[-1]
    if op not in message:
        return f"the error does not name the op {op!r}: {message[:300]}"
    quoted = set(re.findall(r"'([A-Za-z_][A-Za-z0-9_]*)(?:\[\d+\])?'", message))
    # unquoted, a distinctive name will do (torch_npu's own rotary_mode text names it so)
    bare = {a for a in _arg_names(spec) if ("_" in a or len(a) > 4)
            and re.search(rf"\b{re.escape(a)}\b", message)}
    if not (quoted | bare) & set(_arg_names(spec)):
        return f"the error names no argument of {op}: {message[:300]}"
    return None


def _tensors_of(kw: dict) -> list[torch.Tensor]:
    tensors = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    return tensors + [t for v in kw.values() if isinstance(v, list) for t in v
                      if isinstance(t, torch.Tensor)]


def _on_cpu(kw: dict) -> dict:
    """kw with every meta tensor replaced by CPU zeros of its shape and dtype."""
    def cpu(v):
        if isinstance(v, torch.Tensor) and v.device.type == "meta":
            return torch.zeros(v.shape, dtype=v.dtype)
        if isinstance(v, list):
            return [cpu(t) for t in v]
        return v
    return {k: cpu(v) for k, v in kw.items()}


def _in_float64(kw: dict) -> dict:
    """kw with floating tensors in float64: the references then compute past float32's range
    (3.4e38 * 1.702 is finite there), and the comparison rounds their result to the op's dtype."""
    def up(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.double()
        if isinstance(v, list):
            return [up(t) for t in v]
        return v
    return {k: up(v) for k, v in kw.items()}


def _lowest_precision(kw: dict, outputs: list) -> torch.dtype:
    """The least precise floating dtype among the call's tensors: it sets the tolerance."""
    tensors = _tensors_of(kw) + [t for t in outputs if isinstance(t, torch.Tensor)]
    for dtype in (torch.bfloat16, torch.float16):
        if any(t.dtype == dtype for t in tensors):
            return dtype
    return torch.float32


def _compare(i: int, got, want, spec: OpSpec, lowest_precision: torch.dtype) -> str | None:
    if want is None:
        return None
    if isinstance(want, ShapeOnly):
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            return f"output {i}: {tuple(got.shape)} {got.dtype}, expected {want.shape} {want.dtype}"
        return None
    if not isinstance(got, torch.Tensor):
        return f"output {i}: {type(got).__name__}, expected a tensor"
    if got.device.type != "cpu":
        return f"output {i} on {got.device} from CPU inputs"
    if tuple(got.shape) != tuple(want.shape):
        return f"output {i}: shape {tuple(got.shape)}, reference {tuple(want.shape)}"
    if got.is_floating_point() or want.is_floating_point():
        atol, rtol = tolerance(lowest_precision)
        if got.is_floating_point():
            want = want.to(got.dtype)  # rounded as the op must round it (overflow to inf)
        try:
            torch.testing.assert_close(got.double(), want.double(), equal_nan=True,
                                       atol=atol * spec.sum_tolerance * 10,
                                       rtol=rtol * spec.sum_tolerance * 10)
        except AssertionError as error:
            return f"output {i}: {str(error)[:400]}"
        return None
    # integer outputs (codes, indices): quantised codes may differ by one at a rounding tie
    diff = (got.long() - want.long()).abs()
    limit = 1 if got.dtype in (torch.int8, torch.int32) and "quant" in spec.name else 0
    if diff.numel() and diff.max().item() > limit:
        return f"output {i}: integers differ by up to {diff.max().item()}"
    return None


def judge(spec: OpSpec, mutation: Mutation, seed: int) -> str | None:
    """Runs one case (in the isolated child): None if it ends well, else what went wrong."""
    torch.manual_seed(seed)
    kw = mutation.apply(spec.build())
    try:
        result = spec.call(**kw)
    except Exception as error:  # noqa: BLE001 (every error is judged on its message)
        if _allocation_refused(error):
            return None  # the arguments ask for more memory than the case may use (isolation)
        return named_error(spec, f"{type(error).__name__}: {error}")
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    tensors = _tensors_of(kw)
    all_meta = bool(tensors) and all(t.device.type == "meta" for t in tensors)
    if all_meta:  # meta in, meta out: judged by shape and dtype against CPU zeros
        kw = _on_cpu(kw)
    if tensors and all(t.device.type == "npu" for t in tensors):
        # npu in, npu out: the same values as on CPU (npu memory is host memory)
        for i, t in enumerate(outputs):
            if isinstance(t, torch.Tensor) and t.device.type != "npu":
                return f"output {i} on {t.device} from npu inputs"
        outputs = [t.cpu() if isinstance(t, torch.Tensor) else t for t in outputs]
        kw = _all_on("cpu")(kw)
    # The reference runs in float64 (exact past float32's range), and again on the arguments as
    # given when that differs: an op computing in float32 may overflow where float64 does not,
    # as the native float32 composition would. Matching either one passes.
    problems = []
    for ref_kw in (_in_float64(kw), kw):
        problem = _check_against_reference(spec, ref_kw, outputs, all_meta, kw)
        if problem is None:
            return None
        problems.append(problem)
    return problems[0]


def _check_against_reference(spec, ref_kw, outputs, all_meta, kw) -> str | None:
    try:
        expected = spec.reference(ref_kw)
    except Exception as error:  # noqa: BLE001
        return (f"accepted, but the reference rejects these arguments "
                f"({type(error).__name__}: {str(error)[:200]})")
    if len(expected) > len(outputs):
        return f"{len(outputs)} outputs, the reference has {len(expected)}"
    lowest = _lowest_precision(kw, outputs)
    for i, want in enumerate(expected):
        got = outputs[i]
        if all_meta and isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
            if got.device.type != "meta":
                return f"output {i} on {got.device} from meta inputs"
            want = ShapeOnly(tuple(want.shape), got.dtype)
        problem = _compare(i, got, want, spec, lowest)
        if problem:
            return problem
    return None
