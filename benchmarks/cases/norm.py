"""RMSNorm family: rms_norm (fwd, bwd), gemma_rms_norm, add_rms_norm, add_rms_norm_v2, and graph
mode's add_rms_norm_inplace rule (the sum written into a dead addend's buffer)."""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from opennpu.testing import reference
from opennpu.testing.timing import autograd_backward, compiled

from ..common import Case, Timed, randn

EPS = 1e-6
npu = torch.ops.npu


def shapes(quick: bool):
    """(T, H) pairs, shared with fast_gelu."""
    tokens = (1, 4096) if quick else (1, 128, 4096, 8192)
    hidden = (4096,) if quick else (4096, 5120, 8192)
    return itertools.product(tokens, hidden)


def native_gemma_rms_norm(x, weight, eps=EPS):
    """Gemma's RMSNorm in the seed's style: the native RMSNorm with weight (1 + gamma)."""
    return reference.native_rms_norm(x, 1 + weight, eps)


def f_rms_norm(x, weight, eps=EPS):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _inputs(t, h, dtype):
    return randn(t, h, dtype=dtype), (1 + 0.1 * torch.randn(h)).to(dtype)


def rms_norm_fwd(t, h, dtype, threads):
    x, w = _inputs(t, h, dtype)
    native_compiled = compiled(reference.native_rms_norm, x, w, threads=threads)
    return Timed(
        ours=lambda: npu.npu_rms_norm(x, w, EPS)[0],
        baselines={
            "eager": lambda: reference.native_rms_norm(x, w, EPS),
            "compile": lambda: native_compiled(x, w, EPS),
            "F.rms_norm": lambda: f_rms_norm(x, w),
        },
        reference=lambda: reference.rms_norm(x, w, EPS)[0],
    )


def rms_norm_bwd(t, h, dtype, threads):
    x, w = _inputs(t, h, dtype)
    dy = randn(t, h, dtype=dtype)
    rstd = npu.npu_rms_norm(x, w, EPS)[1]
    native_compiled = compiled(reference.native_rms_norm, x, w, threads=threads)
    return Timed(
        ours=lambda: npu.npu_rms_norm_backward(dy, x, w, rstd),
        baselines={
            "eager": autograd_backward(reference.native_rms_norm, (x, w), dy),
            "compile": autograd_backward(native_compiled, (x, w), dy),
            "F.rms_norm": autograd_backward(f_rms_norm, (x, w), dy),
        },
        reference=lambda: reference.rms_norm_backward(dy, x, w, reference.rms_norm(x, w, EPS)[1]),
    )


def gemma_rms_norm_fwd(t, h, dtype, threads):
    x, w = _inputs(t, h, dtype)
    w = w - 1  # gemma stores gamma - 1
    native_compiled = compiled(native_gemma_rms_norm, x, w, threads=threads)
    return Timed(
        ours=lambda: npu.npu_gemma_rms_norm(x, w, EPS)[0],
        baselines={
            "eager": lambda: native_gemma_rms_norm(x, w),
            "compile": lambda: native_compiled(x, w),
        },
        reference=lambda: reference.gemma_rms_norm(x, w, EPS)[0],
    )


def add_rms_norm_fwd(t, h, dtype, threads):
    x1, w = _inputs(t, h, dtype)
    x2 = randn(t, h, dtype=dtype)
    native_compiled = compiled(reference.native_add_rms_norm, x1, x2, w, threads=threads)
    return Timed(
        ours=lambda: npu.npu_add_rms_norm(x1, x2, w, EPS)[::2],  # (y, x1 + x2)
        baselines={
            "eager": lambda: reference.native_add_rms_norm(x1, x2, w, EPS),
            "compile": lambda: native_compiled(x1, x2, w, EPS),
        },
        reference=lambda: reference.add_rms_norm(x1, x2, w, EPS)[::2],
    )


def add_rms_norm_v2_fwd(t, h, dtype, threads):
    """The in-place op against the native composition writing its results into the inputs too
    (each call adds y to the residual again: values drift, times do not)."""
    x1, w = _inputs(t, h, dtype)
    x2 = randn(t, h, dtype=dtype)
    a, b, c, d, e, f = (x1.clone(), x2.clone(), x1.clone(), x2.clone(), x1.clone(), x2.clone())

    def native_in_place(x1, x2, w):
        y, x = reference.native_add_rms_norm(x1, x2, w, EPS)
        x1.copy_(y)
        x2.copy_(x)
        return x1, x2

    # compile of the composition, the two copies eager (Inductor fails on the in-place form)
    native_compiled = compiled(reference.native_add_rms_norm, e, f, w, EPS, threads=threads)

    def compiled_in_place():
        y, x = native_compiled(e, f, w, EPS)
        e.copy_(y)
        f.copy_(x)
        return e, f

    def ours():
        npu.npu_add_rms_norm_v2(a, b, w, EPS)
        return a, b

    return Timed(
        ours=ours,
        baselines={"eager": lambda: native_in_place(c, d, w),
                   "compile": compiled_in_place},
        reference=None,  # the inputs change with every call
    )


def _three_adds(residual, h1, h2, h3, gamma):
    """Three residual adds, each feeding a norm, as consecutive decoder layers have them (their
    attention and MLP left out: h1..h3 stand for those outputs). The first sum adds two graph
    inputs; the later ones add to the previous sum, which nothing reads afterwards."""
    y1, _, x = npu.npu_add_rms_norm(h1, residual, gamma, EPS)
    y2, _, x = npu.npu_add_rms_norm(h2, x, gamma, EPS)
    y3, _, x = npu.npu_add_rms_norm(h3, x, gamma, EPS)
    return y1, y2, y3, x


def _opennpu_compiled(fn, args, threads, disabled=()):
    from opennpu.compile import CompilerConfig, get_npu_backend

    config = CompilerConfig()
    config.experimental_config.disabled_patterns = list(disabled)
    backend = get_npu_backend(compiler_config=config)
    compiled_fn = torch.compile(fn, backend=backend, dynamic=False)
    with torch._inductor.config.patch({"cpp.threads": threads}):
        compiled_fn(*args)
    return compiled_fn, backend


def add_rms_norm_inplace_graph(t, h, dtype, threads):
    """opennpu's backend with the add_rms_norm_inplace rule (2 of the 3 sums written into the
    previous sum's buffer) against the same backend with the rule off, and eager."""
    residual, w = _inputs(t, h, dtype)
    args = (residual, *(randn(t, h, dtype=dtype) for _ in range(3)), w)
    ours, backend = _opennpu_compiled(_three_adds, args, threads)
    off, _ = _opennpu_compiled(_three_adds, args, threads, disabled=["add_rms_norm_inplace"])
    fusions = ", ".join(f"{rule} {n}" for rule, n in sorted(backend.fusions.items()))
    return Timed(
        ours=lambda: ours(*args),
        baselines={"eager": lambda: _three_adds(*args), "rule off": lambda: off(*args)},
        reference=None,
        info=f"fusions: {fusions or 'none'}",
    )


def add_rms_norm_inplace_op(t, h, dtype, threads):
    """The op itself: the sum into x2's buffer (each call adds x1 to it again: values drift,
    times do not) against npu_add_rms_norm's new output."""
    x1, w = _inputs(t, h, dtype)
    x2 = randn(t, h, dtype=dtype)
    scratch = x2.clone()
    return Timed(
        ours=lambda: torch.ops.opennpu._add_rms_norm_inplace(x1, scratch, w, EPS),
        baselines={"eager": lambda: reference.native_add_rms_norm(x1, x2, w, EPS),
                   "npu_add_rms_norm": lambda: npu.npu_add_rms_norm(x1, x2, w, EPS)},
        reference=None,
    )


def cases(quick: bool, dtypes):
    for (t, h), dtype in itertools.product(shapes(quick), dtypes):
        e = dtype.itemsize
        shape = f"T={t} H={h}"
        fwd_bytes = 2 * t * h * e + h * e + 4 * t  # x, y, gamma and the fp32 rstd
        bwd_bytes = 3 * t * h * e + h * e + 4 * t + 4 * h  # dy, x, dx, gamma, rstd, fp32 dgamma
        yield Case("rms_norm", "fwd", shape, dtype, fwd_bytes,
                   functools.partial(rms_norm_fwd, t, h, dtype), ("npu_rms_norm",))
        yield Case("rms_norm", "bwd", shape, dtype, bwd_bytes,
                   functools.partial(rms_norm_bwd, t, h, dtype),
                   ("npu_rms_norm", "npu_rms_norm_backward"))
        yield Case("gemma_rms_norm", "fwd", shape, dtype, fwd_bytes,
                   functools.partial(gemma_rms_norm_fwd, t, h, dtype), ("npu_gemma_rms_norm",))
        yield Case("add_rms_norm", "fwd", shape, dtype, 4 * t * h * e + h * e + 4 * t,
                   functools.partial(add_rms_norm_fwd, t, h, dtype), ("npu_add_rms_norm",))
        yield Case("add_rms_norm_v2", "fwd", shape, dtype, 4 * t * h * e + h * e + 4 * t,
                   functools.partial(add_rms_norm_v2_fwd, t, h, dtype), ("npu_add_rms_norm_v2",))
        if t >= 4096:  # the rule matters where the tensors outgrow the caches
            yield Case("add_rms_norm_inplace", "fwd", f"{shape} op", dtype,
                       4 * t * h * e + h * e + 4 * t,
                       functools.partial(add_rms_norm_inplace_op, t, h, dtype),
                       ("npu_add_rms_norm",))
            yield Case("add_rms_norm_inplace", "fwd", f"{shape} 3 adds", dtype,
                       3 * (4 * t * h * e + h * e + 4 * t),
                       functools.partial(add_rms_norm_inplace_graph, t, h, dtype),
                       ("npu_add_rms_norm",))
