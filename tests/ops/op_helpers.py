"""Helpers shared by the op test modules (tests/ops/test_*.py).

Every comparison goes through opennpu.testing (the same oracles and tolerance table the benchmarks
use); the helpers here only add the recurring test patterns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch._dynamo.testing

from opennpu.testing.tolerances import assert_close, tolerance

LOW_DTYPES = (torch.float16, torch.bfloat16)
GRAD_DTYPES = (torch.float32, torch.bfloat16)
SETTINGS = dict(max_examples=15, deadline=None, derandomize=True, database=None)


def dtype_id(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def randn(*shape, dtype=torch.float32, requires_grad=False) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype).requires_grad_(requires_grad)


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.numel() == 0:
        return 0.0
    return (actual.double() - expected.double()).abs().max().item()


def assert_not_worse_than_native(ours: torch.Tensor, native: torch.Tensor,
                                 ref: torch.Tensor) -> None:
    """The fused op (fp32 accumulation, one rounding) is at least as accurate as the eager
    composition run in the low dtype, up to one atol of the tolerance table."""
    assert ours.dtype == native.dtype, (ours.dtype, native.dtype)
    atol, _ = tolerance(ours.dtype)
    err_ours, err_native = max_err(ours, ref), max_err(native, ref)
    assert err_ours <= err_native + atol, (
        f"fused op max error {err_ours:.3g} > native {ours.dtype} composition's "
        f"{err_native:.3g} + atol {atol:g}"
    )


def check_outputs(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor],
                  dtypes: Sequence[torch.dtype], scale: float = 1.0) -> None:
    """Each output has the expected dtype and matches its reference under that dtype's tolerance."""
    assert len(outs) == len(refs) == len(dtypes)
    for i, (out, ref, dt) in enumerate(zip(outs, refs, dtypes)):
        assert out.dtype == dt, f"output {i}: dtype {out.dtype}, expected {dt}"
        assert out.shape == ref.shape, f"output {i}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
        assert_close(out, ref, scale=scale, msg=f"output {i}")


def grads_of(fn: Callable, inputs: Sequence[torch.Tensor], grad_out) -> list:
    """Gradients of sum(fn(*inputs) * grad_out) (float32 loss) w.r.t. the inputs that need them.

    fn returns one tensor or a tuple; grad_out is a tensor or a tuple matching it (None = skip)."""
    out = fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    gos = grad_out if isinstance(grad_out, (tuple, list)) else (grad_out,)
    loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, gos) if g is not None)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return list(torch.autograd.grad(loss, leaves))


def leaf_copies(tensors: Sequence, dtype=None) -> list:
    """Fresh leaves (optionally cast) with the same requires_grad, for a second autograd run."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            c = t.detach().to(dtype) if dtype is not None else t.detach().clone()
            out.append(c.requires_grad_(t.requires_grad))
        else:
            out.append(t)
    return out


def check_compiled_matches_eager(fn: Callable, make_inputs: Callable[[Sequence[int]], list],
                                 shapes: Sequence[Sequence[int]], backend: str = "aot_eager",
                                 tol: float = 0.0) -> None:
    """torch.compile(fn, fullgraph=True, dynamic=True, backend=backend): forward and gradients
    equal eager for each entry of `shapes` (same rank, sizes >= 2), compiled into exactly one
    frame (no graph break and no recompilation for the later shapes). fn returns a tuple of
    tensors. aot_eager runs the same kernels, so forward outputs must be bit-identical (tol=0);
    inductor may re-fuse the surrounding pointwise ops, so give it a small tol."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    for shape in shapes:
        inputs = make_inputs(shape)
        grad_outs = [torch.randn_like(o) for o in fn(*leaf_copies(inputs))]
        eager_in, comp_in = leaf_copies(inputs), leaf_copies(inputs)
        eager_out, comp_out = fn(*eager_in), compiled(*comp_in)
        for e, c in zip(eager_out, comp_out):
            torch.testing.assert_close(c, e, rtol=tol, atol=tol)
        eager_g = grads_of(fn, eager_in, grad_outs)
        comp_g = grads_of(compiled, comp_in, grad_outs)
        assert len(comp_g) == len(eager_g) > 0
        for e, c in zip(eager_g, comp_g):
            torch.testing.assert_close(c, e, rtol=max(tol, 1e-6), atol=max(tol, 1e-6))
    frames = counter.frame_count
    assert frames == 1, f"{frames} frames compiled (graph break or recompilation)"
    torch._dynamo.reset()


def opcheck(op, samples: Sequence[tuple]) -> None:
    """torch.library.opcheck on every (args, kwargs) sample."""
    for args, kwargs in samples:
        torch.library.opcheck(op, args, kwargs)
