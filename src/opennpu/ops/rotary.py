"""Rotary embedding: npu_rotary_mul and npu_rotary_mul_backward (Ascend RotaryMul / RotaryMulGrad),
npu_interleave_rope, npu_apply_rotary_pos_emb and npu_kv_rmsnorm_rope_cache(_v2, _v2_functional).

``out = x * r1 + rotate(x) * r2`` with r1 = cos and r2 = sin broadcast against x (any of the
BNSD, BSND, SBND, TND patterns, or any other broadcast). Computed in float32; r1/r2 given in
float32 are used unrounded with float16/bfloat16 x.
"""

from __future__ import annotations

import torch

from ._registry import (accepts_input_keyword, mark_backward_op, mark_not_differentiable,
                        register_autograd, register_fake)

_ops = torch.ops.npu


@accepts_input_keyword
def npu_rotary_mul(self, r1, r2, rotary_mode: str = "half", rotate=None):
    """Apply rotary position embedding.

    ``rotary_mode='half'``: ``rotate(x) = cat(-x[..., D/2:], x[..., :D/2])`` (Llama's
    rotate_half); ``'interleave'``: pairs ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])``.
    ``rotate`` (optional ``[D, D]`` matrix) replaces the rotation by ``x @ rotate``.
    Differentiable in ``self``, ``r1`` and ``r2`` (not in ``rotate``).
    """
    return _ops.npu_rotary_mul(self, r1, r2, rotary_mode, rotate)


@accepts_input_keyword
def npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode: str = "half"):
    """Returns ``(dx, dr1, dr2)``: ``dx = r1*g + rotate^T(r2*g)``, and ``dr1``/``dr2`` the sums of
    ``x*g`` / ``rotate(x)*g`` over the dims r1/r2 broadcast along (shapes of r1/r2, dtype of x)."""
    return _ops.npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode)


@register_fake("npu::npu_rotary_mul")
def _rotary_mul_fake(self, r1, r2, rotary_mode="half", rotate=None):
    return self.new_empty(self.shape)


@register_fake("npu::npu_rotary_mul_backward")
def _rotary_mul_backward_fake(grad, self, r1, r2, rotary_mode="half"):
    return self.new_empty(self.shape), self.new_empty(r1.shape), self.new_empty(r2.shape)


@register_fake("opennpu::_rotary_mul_backward_dx")
def _rotary_mul_backward_dx_fake(grad, self, r1, r2, rotary_mode="half"):
    return torch.empty(self.shape, dtype=self.dtype, device=self.device)


def _setup(ctx, inputs, output):
    self, r1, r2, mode, rotate = inputs
    ctx.mode = mode
    ctx.save_for_backward(self, r1, r2, rotate)


def _backward(ctx, grad):
    x, r1, r2, rotate = ctx.saved_tensors
    need = ctx.needs_input_grad
    if rotate is None and not (need[1] or need[2]):
        # cos/sin as constants (the usual case): dx alone, without the dr1/dr2 reductions.
        dx = None if not need[0] else torch.ops.opennpu._rotary_mul_backward_dx(
            grad, x, r1, r2, ctx.mode)
        return dx, None, None, None, None
    if rotate is None:
        dx, dr1, dr2 = _ops.npu_rotary_mul_backward(grad, x, r1, r2, ctx.mode)
    else:
        # x @ rotate path: the adjoint of the matrix is its transpose (computed in float32).
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        g, xf, m = grad.to(acc), x.to(acc), rotate.to(acc)
        gs = g * r2.to(acc)
        dx = (g * r1.to(acc) + gs @ m.t()).to(x.dtype)
        dr1 = (xf * g).sum_to_size(r1.shape).to(x.dtype)
        dr2 = ((xf @ m) * g).sum_to_size(r2.shape).to(x.dtype)
    return (
        dx if need[0] else None,
        dr1.to(r1.dtype) if need[1] else None,
        dr2.to(r2.dtype) if need[2] else None,
        None,
        None,
    )


register_autograd("npu_rotary_mul", _backward, _setup)
mark_backward_op("npu_rotary_mul_backward", "npu_rotary_mul")


# ----------------------------------------------------------------------------- inference ropes


def npu_interleave_rope(x, cos, sin):
    """DeepSeek's rope of one input: ``q = cat(x[..., 0::2], x[..., 1::2])`` (each pair split into
    the two halves), then ``q * cos + rotate_half(q) * sin``. x ``[B, N, S, D]`` (any rank, D
    even), cos / sin broadcast to x (``[B, 1, S or 1, D]``); fp16 / bf16 / fp32 computed in
    float32, rounded once. Not differentiable (torch_npu registers no gradient)."""
    return _ops.npu_interleave_rope(x, cos, sin)


def npu_apply_rotary_pos_emb(query, key, cos, sin, layout: str = "BSND",
                             rotary_mode: str = "half"):
    """``x * cos + rotate(x) * sin`` for ``x`` = query and key, **written into query and key**,
    which are returned (as torch_npu). ``layout`` 'BSND' / 'SBND' / 'BNSD' (4-D) or 'TND' (3-D);
    cos / sin have N = 1 and broadcast to both (key may have another N than query); all four of
    one dtype. ``rotary_mode`` 'half' or 'interleave' ('quarter' is not implemented). Computed in
    float32, rounded once. Not differentiable (torch_npu registers no gradient)."""
    return _ops.npu_apply_rotary_pos_emb(query, key, cos, sin, layout, rotary_mode)


def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
                              k_rope_scale=None, c_kv_scale=None, k_rope_offset=None,
                              c_kv_offset=None, v=None, epsilon: float = 1e-5,
                              cache_mode: str = "Norm", is_output_kv: bool = False):
    """MLA's KV step: ``kv [B, 1, S, Dc + Dr]`` splits into ``c = rms_norm(kv[..., :Dc]) * gamma``
    and ``k = interleave_rope(kv[..., Dc:], cos, sin)``; k goes into ``k_cache`` and c into
    ``ckv_cache`` **in place** at the rows ``index`` names (``cache_mode`` 'Norm', 'PA' /
    'PA_BNSD', 'PA_NZ', 'PA_BLK_BNSD', 'PA_BLK_NZ'; a negative index skips the token). With
    ``v`` (V2): the whole kv row is normalised, its first Dr elements rotated, that row goes to
    k_cache and v to ckv_cache. A ``k_rope_scale`` / ``c_kv_scale`` makes its (int8) cache hold
    ``round(value * scale)`` clamped to [-128, 127]. Returns ``(k_cache, ckv_cache, k, c)`` with
    k / c in kv's dtype (always filled; ``is_output_kv`` changes nothing). Computed in float32.
    Not differentiable."""
    return _ops.npu_kv_rmsnorm_rope_cache(
        kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale=k_rope_scale,
        c_kv_scale=c_kv_scale, k_rope_offset=k_rope_offset, c_kv_offset=c_kv_offset, v=v,
        epsilon=epsilon, cache_mode=cache_mode, is_output_kv=is_output_kv)


def npu_kv_rmsnorm_rope_cache_v2(kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
                                 k_rope_scale=None, c_kv_scale=None, k_rope_offset=None,
                                 c_kv_offset=None, v=None, epsilon: float = 1e-5,
                                 cache_mode: str = "Norm", is_output_kv: bool = False,
                                 k_cache_dtype=None, ckv_cache_dtype=None):
    """npu_kv_rmsnorm_rope_cache with the cache writes declared in the schema (safe under
    torch.compile); returns ``(k, c)``. ``k_cache_dtype`` / ``ckv_cache_dtype`` (fp8 /
    hifloat8 reinterpretation) are not implemented: pass None."""
    return _ops.npu_kv_rmsnorm_rope_cache_v2(
        kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale=k_rope_scale,
        c_kv_scale=c_kv_scale, k_rope_offset=k_rope_offset, c_kv_offset=c_kv_offset, v=v,
        epsilon=epsilon, cache_mode=cache_mode, is_output_kv=is_output_kv,
        k_cache_dtype=k_cache_dtype, ckv_cache_dtype=ckv_cache_dtype)


def npu_kv_rmsnorm_rope_cache_v2_functional(kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
                                            k_rope_scale=None, c_kv_scale=None,
                                            k_rope_offset=None, c_kv_offset=None, v=None,
                                            epsilon: float = 1e-5, cache_mode: str = "Norm",
                                            is_output_kv: bool = False, k_cache_dtype=None,
                                            ckv_cache_dtype=None):
    """npu_kv_rmsnorm_rope_cache_v2 into copies of the caches; returns
    ``(k, c, k_cache, ckv_cache)``."""
    return _ops.npu_kv_rmsnorm_rope_cache_v2_functional(
        kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale=k_rope_scale,
        c_kv_scale=c_kv_scale, k_rope_offset=k_rope_offset, c_kv_offset=c_kv_offset, v=v,
        epsilon=epsilon, cache_mode=cache_mode, is_output_kv=is_output_kv,
        k_cache_dtype=k_cache_dtype, ckv_cache_dtype=ckv_cache_dtype)


@register_fake("npu::npu_interleave_rope")
def _interleave_rope_fake(x, cos, sin):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _check_apply_rotary_pos_emb_args(layout, rotary_mode):
    torch._check(layout in ("BSND", "SBND", "BNSD", "TND"),
                 lambda: f"npu_apply_rotary_pos_emb: argument 'layout' must be 'BSND', 'SBND', "
                         f"'BNSD' or 'TND', but got '{layout}'")
    torch._check(rotary_mode in ("half", "interleave"),
                 lambda: f"npu_apply_rotary_pos_emb: argument 'rotary_mode' must be 'half' or "
                         f"'interleave', but got '{rotary_mode}'")


@register_fake("npu::npu_apply_rotary_pos_emb")
def _apply_rotary_pos_emb_fake(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    _check_apply_rotary_pos_emb_args(layout, rotary_mode)
    return query, key  # written in place and returned, as the real kernel does


def _kv_rope_sizes(kv, gamma, cos, v):
    lead = (kv.shape[0], 1, kv.shape[2])
    if v is None:
        return lead + (cos.shape[-1],), lead + (gamma.shape[0],)
    return lead + (kv.shape[-1],), lead + (v.shape[-1],)


def _kv_rope_outputs(kv, gamma, cos, v):
    k_size, c_size = _kv_rope_sizes(kv, gamma, cos, v)
    return (torch.empty(k_size, dtype=kv.dtype, device=kv.device),
            torch.empty(c_size, dtype=kv.dtype, device=kv.device))


@register_fake("npu::npu_kv_rmsnorm_rope_cache")
def _kv_rmsnorm_rope_cache_fake(kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
                                k_rope_scale=None, c_kv_scale=None, k_rope_offset=None,
                                c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                                is_output_kv=False):
    return (k_cache, ckv_cache, *_kv_rope_outputs(kv, gamma, cos, v))  # caches as the kernel


@register_fake("npu::npu_kv_rmsnorm_rope_cache_v2")
def _kv_rmsnorm_rope_cache_v2_fake(kv, gamma, cos, sin, index, k_cache, ckv_cache, **kwargs):
    return _kv_rope_outputs(kv, gamma, cos, kwargs.get("v"))


@register_fake("npu::npu_kv_rmsnorm_rope_cache_v2_functional")
def _kv_rmsnorm_rope_cache_v2_functional_fake(kv, gamma, cos, sin, index, k_cache, ckv_cache,
                                              **kwargs):
    return (*_kv_rope_outputs(kv, gamma, cos, kwargs.get("v")),
            torch.empty_like(k_cache, memory_format=torch.contiguous_format),
            torch.empty_like(ckv_cache, memory_format=torch.contiguous_format))


# npu_apply_rotary_pos_emb and npu_kv_rmsnorm_rope_cache write into arguments that their
# (torch_npu) schemas do not mark as written. Under functionalization (torch.compile, export)
# each becomes its functional form, and the arguments take the results: so a compiled graph
# keeps the writes, in order, as eager code sees them.
def _functionalize_api(tensors):
    from torch._subclasses.functional_tensor import CppFunctionalizeAPI

    api = CppFunctionalizeAPI()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            api.sync(t)
    return api


def _commit(api, target, value):
    api.replace(target, value)
    api.commit_update(target)


@torch.library.impl("npu::npu_apply_rotary_pos_emb", "Functionalize")
def _apply_rotary_pos_emb_functionalize(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    api = _functionalize_api((query, key, cos, sin))
    q, k, c, s = api.unwrap_tensors((query, key, cos, sin))
    with api.redispatch_to_next():
        # the checks of the op (its fake kernel), then its math: npu_rotary_mul of each input
        _check_apply_rotary_pos_emb_args(layout, rotary_mode)
        q_out = _ops.npu_rotary_mul(q, c, s, rotary_mode)
        k_out = _ops.npu_rotary_mul(k, c, s, rotary_mode)
    _commit(api, query, q_out)
    _commit(api, key, k_out)
    return query, key


@torch.library.impl("npu::npu_kv_rmsnorm_rope_cache", "Functionalize")
def _kv_rmsnorm_rope_cache_functionalize(kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
                                         k_rope_scale=None, c_kv_scale=None, k_rope_offset=None,
                                         c_kv_offset=None, v=None, epsilon=1e-5,
                                         cache_mode="Norm", is_output_kv=False):
    args = (kv, gamma, cos, sin, index, k_cache, ckv_cache)
    kw = dict(k_rope_scale=k_rope_scale, c_kv_scale=c_kv_scale, k_rope_offset=k_rope_offset,
              c_kv_offset=c_kv_offset, v=v)
    api = _functionalize_api((*args, *kw.values()))
    u_args = api.unwrap_tensors(args)
    u_kw = {name: (api.unwrap_tensors(t) if isinstance(t, torch.Tensor) else t)
            for name, t in kw.items()}
    with api.redispatch_to_next():
        k, c, k_new, c_new = _ops.npu_kv_rmsnorm_rope_cache_v2_functional(
            *u_args, **u_kw, epsilon=epsilon, cache_mode=cache_mode, is_output_kv=is_output_kv)
    _commit(api, k_cache, k_new)
    _commit(api, ckv_cache, c_new)
    return k_cache, ckv_cache, api.wrap_tensors(k), api.wrap_tensors(c)


_REASON = "an inference op; torch_npu registers no gradient"
for _name in ("npu_interleave_rope", "npu_apply_rotary_pos_emb", "npu_kv_rmsnorm_rope_cache",
              "npu_kv_rmsnorm_rope_cache_v2", "npu_kv_rmsnorm_rope_cache_v2_functional"):
    mark_not_differentiable(_name, _REASON)
del _name

__all__ = ["npu_rotary_mul", "npu_rotary_mul_backward", "npu_interleave_rope",
           "npu_apply_rotary_pos_emb", "npu_kv_rmsnorm_rope_cache", "npu_kv_rmsnorm_rope_cache_v2",
           "npu_kv_rmsnorm_rope_cache_v2_functional"]
