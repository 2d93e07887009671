"""TorchAir's three default rules (seed 003), on the post_grad graphs, in TorchAir's variants.

(a) npu_add_rms_norm's y into npu_dynamic_quant(y, smooth_scales=s)
    -> npu_add_rms_norm_dynamic_quant(..., smooth_scale1=s, output_mask=[True, False])
(b) npu_add_rms_norm's y through flatten(0, 1) into npu_dynamic_quant(y) (no smooth scales),
    the scale viewed (-1, 1) -> the same fused op, flatten and view applied to its outputs
(c) npu_add_rms_norm's y, optionally viewed (-1, h) with h its last size, cast to float32
    -> npu_add_rms_norm_cast

Each comes with and without an explicit epsilon (the dispatcher drops an epsilon equal to the
default, so the two spellings are different graphs) and with x_out used or not. The cast is
matched as aten._to_copy (what x.to(torch.float32) / x.float() become after AOTAutograd).
Numerics: the fused ops quantise / cast the same fp32 y the separate ops compute before rounding it
to x1's dtype, so they are at least as accurate; output_mask [True, False] is TorchAir's fix for
dynamic shapes (b268bc09) and leaves the unused branch out.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fusion import fusion_rule
from ._util import drop_eps, empty, val

EPS = 2e-6
npu = torch.ops.npu


def _fused_ok(match) -> bool:
    x1, x2, gamma = val(match, "x1"), val(match, "x2"), val(match, "gamma")
    return (x1.dtype in (torch.float16, torch.bfloat16, torch.float32) and x2.dtype == x1.dtype
            and gamma.dtype == x1.dtype and x1.shape == x2.shape and gamma.dim() == 1)


def _register(r, search, replace, inputs, extra_check, with_eps: bool,
              generic_sizes: bool = False) -> None:
    if with_eps:
        r.replacement(search, replace, inputs, extra_check=extra_check,
                      scalar_workaround={"eps": EPS}, generic_sizes=generic_sizes)
    else:
        r.replacement(drop_eps(search), drop_eps(replace), inputs, extra_check=extra_check,
                      generic_sizes=generic_sizes)


def _reshapes(match):
    """(input node, output shape) of each reshape in the match (the views, after AOTAutograd)."""
    return [(n.args[0], n.meta["val"].shape) for n in match.nodes
            if n.target is torch.ops.aten.reshape.default]


def _equal_shapes(a, b) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _smooth_ok(match) -> bool:
    scale = val(match, "smooth")
    return _fused_ok(match) and scale.dtype == val(match, "x1").dtype and scale.dim() == 1


def _variants(with_eps: bool):
    """(call add_rms_norm, call fused op with these kwargs) for one epsilon spelling."""
    def add_rms_norm(x1, x2, gamma, eps):
        return npu.npu_add_rms_norm(x1, x2, gamma, eps) if with_eps else npu.npu_add_rms_norm(x1, x2, gamma)

    def fused_kwargs(eps):
        return {"epsilon": eps} if with_eps else {}

    return add_rms_norm, fused_kwargs


def _register_smooth_quant(r, with_eps: bool) -> None:
    arn, kw = _variants(with_eps)

    def search(x1, x2, gamma, smooth, eps):
        y, _, x = arn(x1, x2, gamma, eps)
        q, s = npu.npu_dynamic_quant(y, smooth_scales=smooth)
        return q, s, x

    def replace(x1, x2, gamma, smooth, eps):
        q, _, x, s, _ = npu.npu_add_rms_norm_dynamic_quant(
            x1, x2, gamma, smooth_scale1=smooth, output_mask=[True, False], **kw(eps))
        return q, s, x

    def search_no_x(x1, x2, gamma, smooth, eps):
        return npu.npu_dynamic_quant(arn(x1, x2, gamma, eps)[0], smooth_scales=smooth)

    def replace_no_x(x1, x2, gamma, smooth, eps):
        q, _, _, s, _ = npu.npu_add_rms_norm_dynamic_quant(
            x1, x2, gamma, smooth_scale1=smooth, output_mask=[True, False], **kw(eps))
        return q, s

    for dtype in (torch.float16, torch.bfloat16):
        inputs = [empty(1, 1, 2, dtype=dtype), empty(1, 1, 2, dtype=dtype), empty(2, dtype=dtype),
                  empty(2, dtype=dtype)]
        for s_fn, r_fn in ((search, replace), (search_no_x, replace_no_x)):
            _register(r, s_fn, r_fn, inputs, _smooth_ok, with_eps)


@fusion_rule("torchair_add_rms_norm_dynamic_quant", stage="post_grad",
             doc="npu_add_rms_norm + npu_dynamic_quant(smooth_scales) -> npu_add_rms_norm_dynamic_quant")
def _register_a(r) -> None:
    for with_eps in (False, True):
        _register_smooth_quant(r, with_eps)


def _flatten_ok(match) -> bool:
    """The view sizes, matched as wildcards: y -> (x1[0] * x1[1], *x1[2:]); scale -> (-1, 1)."""
    x1 = val(match, "x1")
    if not (_fused_ok(match) and x1.dim() >= 3):
        return False
    flat = (x1.shape[0] * x1.shape[1], *x1.shape[2:])
    for source, shape in _reshapes(match):
        to_quant = source.target is operator.getitem and source.args[0].target is npu.npu_add_rms_norm.default
        if not (_equal_shapes(shape, flat) if to_quant else (len(shape) == 2 and statically_known_true(shape[1] == 1))):
            return False
    return True


def _cast_ok(match) -> bool:
    """The optional view's sizes, matched as wildcards: (-1, h) with h = x1's last size."""
    x1 = val(match, "x1")
    # The cast's dtype is a wildcard too: it must be float32, the fused op's y_cast dtype.
    casts_to_fp32 = all(n.meta["val"].dtype == torch.float32 for n in match.nodes
                        if n.target is torch.ops.prims.convert_element_type.default)
    return _fused_ok(match) and casts_to_fp32 and all(
        len(shape) == 2 and statically_known_true(shape[1] == x1.shape[-1])
        for _, shape in _reshapes(match))


def _flatten_patterns(with_eps: bool):
    arn, kw = _variants(with_eps)

    def search(x1, x2, gamma, eps):
        y, _, x = arn(x1, x2, gamma, eps)
        q, s = npu.npu_dynamic_quant(y.flatten(0, 1))
        return q, s.view(-1, 1), x

    def replace(x1, x2, gamma, eps):
        q, _, x, s, _ = npu.npu_add_rms_norm_dynamic_quant(
            x1, x2, gamma, output_mask=[True, False], **kw(eps))
        return q.flatten(0, 1), s.view(-1, 1), x

    return [(search, replace)]


@fusion_rule("torchair_add_rms_norm_flatten_dynamic_quant", stage="post_grad",
             doc="npu_add_rms_norm + flatten(0,1) + npu_dynamic_quant + scale.view(-1,1) "
                 "-> npu_add_rms_norm_dynamic_quant")
def _register_b(r) -> None:
    for with_eps in (False, True):
        for dtype in (torch.float16, torch.bfloat16):
            inputs = [empty(2, 3, 4, dtype=dtype), empty(2, 3, 4, dtype=dtype), empty(4, dtype=dtype)]
            for search, replace in _flatten_patterns(with_eps):
                _register(r, search, replace, inputs, _flatten_ok, with_eps, generic_sizes=True)


def _cast_patterns(with_eps: bool):
    """y (used elsewhere or not), x_out, and y cast to float32 with or without view(-1, h)."""
    arn, kw = _variants(with_eps)

    def search_view(x1, x2, gamma, eps):
        y, _, x = arn(x1, x2, gamma, eps)
        return y, x, y.view(-1, y.size(-1)).to(torch.float32)

    def replace_view(x1, x2, gamma, eps):
        y_cast, y, _, x = npu.npu_add_rms_norm_cast(x1, x2, gamma, **kw(eps))
        return y, x, y_cast.view(-1, y.size(-1))

    def search_cast(x1, x2, gamma, eps):
        y, _, x = arn(x1, x2, gamma, eps)
        return y, x, y.to(torch.float32)

    def replace_cast(x1, x2, gamma, eps):
        y_cast, y, _, x = npu.npu_add_rms_norm_cast(x1, x2, gamma, **kw(eps))
        return y, x, y_cast

    def search_view_only(x1, x2, gamma, eps):
        y, _, x = arn(x1, x2, gamma, eps)
        return x, y.view(-1, y.size(-1)).to(torch.float32)

    def replace_view_only(x1, x2, gamma, eps):
        y_cast, y, _, x = npu.npu_add_rms_norm_cast(x1, x2, gamma, **kw(eps))
        return x, y_cast.view(-1, y.size(-1))

    def search_cast_only(x1, x2, gamma, eps):
        y, _, x = arn(x1, x2, gamma, eps)
        return x, y.to(torch.float32)

    def replace_cast_only(x1, x2, gamma, eps):
        y_cast, _, _, x = npu.npu_add_rms_norm_cast(x1, x2, gamma, **kw(eps))
        return x, y_cast

    return [(search_view, replace_view), (search_cast, replace_cast),
            (search_view_only, replace_view_only), (search_cast_only, replace_cast_only)]


@fusion_rule("torchair_add_rms_norm_cast", stage="post_grad",
             doc="npu_add_rms_norm + [view(-1, h)] + to(float32) -> npu_add_rms_norm_cast")
def _register_c(r) -> None:
    for with_eps in (False, True):
        for dtype in (torch.float16, torch.bfloat16):
            inputs = [empty(2, 3, 4, dtype=dtype), empty(2, 3, 4, dtype=dtype), empty(4, dtype=dtype)]
            for search, replace in _cast_patterns(with_eps):
                _register(r, search, replace, inputs, _cast_ok, with_eps, generic_sizes=True)
