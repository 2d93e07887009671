"""TorchAir's three default rules (seed 003), on the post_grad graphs, in TorchAir's variants.

(a) npu_add_rms_norm's y into npu_dynamic_quant(y, smooth_scales=s), or into
    npu_dynamic_quant(y) (seed 003's dump example)
    -> npu_add_rms_norm_dynamic_quant(..., [smooth_scale1=s,] output_mask=[True, False])
(b) npu_add_rms_norm's y through flatten(0, 1) into npu_dynamic_quant(y) (no smooth scales),
    the scale viewed (-1, 1) -> the same fused op, flatten and view applied to its outputs
(c) npu_add_rms_norm's y, optionally viewed (-1, h) with h its last size, cast to float32
    -> npu_add_rms_norm_cast

Each comes with and without an explicit epsilon (the dispatcher drops an epsilon equal to the
default, so the two spellings are different graphs) and with x_out used or not. The cast is
matched as prims.convert_element_type (what x.to(torch.float32) / x.float() become under the
decompositions AOTAutograd runs with).
Numerics: the fused ops quantise / cast the same fp32 y the separate ops compute before rounding it
to x1's dtype, so they are at least as accurate; output_mask [True, False] is TorchAir's fix for
dynamic shapes (b268bc09) and leaves the unused branch out.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..rule_registry import fusion_rule
from ._util import call_eps, drop_eps, empty, val

EPS = 2e-6
npu = torch.ops.npu
HALF_DTYPES = (torch.float16, torch.bfloat16)


# --- checks -----------------------------------------------------------------------------------


def _fused_ok(match) -> bool:
    x1, x2, gamma = val(match, "x1"), val(match, "x2"), val(match, "gamma")
    return (x1.dtype in (torch.float16, torch.bfloat16, torch.float32) and x2.dtype == x1.dtype
            and gamma.dtype == x1.dtype and x1.shape == x2.shape and gamma.dim() == 1)


def _smooth_ok(match) -> bool:
    if "smooth" not in match.kwargs:  # a call without smooth scales is the plain pattern's
        return False
    scale = val(match, "smooth")
    return _fused_ok(match) and scale.dtype == val(match, "x1").dtype and scale.dim() == 1


def _reshapes(match):
    """(input node, output shape) of each reshape in the match (the views, after AOTAutograd)."""
    return [(n.args[0], n.meta["val"].shape) for n in match.nodes
            if n.target is torch.ops.aten.reshape.default]


def _equal_shapes(a, b) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _flatten_ok(match) -> bool:
    """The view sizes, matched as wildcards: y -> (x1[0] * x1[1], *x1[2:]); scale -> (-1, 1)."""
    x1 = val(match, "x1")
    if not (_fused_ok(match) and x1.dim() >= 3):
        return False
    flat = (x1.shape[0] * x1.shape[1], *x1.shape[2:])
    for source, shape in _reshapes(match):
        to_quant = (source.target is operator.getitem
                    and source.args[0].target is npu.npu_add_rms_norm.default)
        if not (_equal_shapes(shape, flat) if to_quant
                else (len(shape) == 2 and statically_known_true(shape[1] == 1))):
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


# --- patterns: eps is None in the default-epsilon spelling (see drop_eps) ------------------------


def _arn(x1, x2, gamma, eps):
    return call_eps(npu.npu_add_rms_norm, x1, x2, gamma, eps=eps)


def _eps_kwargs(eps):
    return {} if eps is None else {"epsilon": eps}


def _quant_search(x1, x2, gamma, smooth, eps):
    y, _, x = _arn(x1, x2, gamma, eps)
    q, s = npu.npu_dynamic_quant(y, smooth_scales=smooth)
    return q, s, x


def _quant_replace(x1, x2, gamma, smooth, eps):
    q, _, x, s, _ = npu.npu_add_rms_norm_dynamic_quant(
        x1, x2, gamma, smooth_scale1=smooth, output_mask=[True, False], **_eps_kwargs(eps))
    return q, s, x


def _quant_search_no_x(x1, x2, gamma, smooth, eps):
    return npu.npu_dynamic_quant(_arn(x1, x2, gamma, eps)[0], smooth_scales=smooth)


def _quant_replace_no_x(x1, x2, gamma, smooth, eps):
    return _quant_replace(x1, x2, gamma, smooth, eps)[:2]


def _plain_search(x1, x2, gamma, eps):
    y, _, x = _arn(x1, x2, gamma, eps)
    q, s = npu.npu_dynamic_quant(y)
    return q, s, x


def _plain_replace(x1, x2, gamma, eps):
    q, _, x, s, _ = npu.npu_add_rms_norm_dynamic_quant(
        x1, x2, gamma, output_mask=[True, False], **_eps_kwargs(eps))
    return q, s, x


def _plain_search_no_x(x1, x2, gamma, eps):
    return _plain_search(x1, x2, gamma, eps)[:2]


def _plain_replace_no_x(x1, x2, gamma, eps):
    return _plain_replace(x1, x2, gamma, eps)[:2]


def _flatten_search(x1, x2, gamma, eps):
    y, _, x = _arn(x1, x2, gamma, eps)
    q, s = npu.npu_dynamic_quant(y.flatten(0, 1))
    return q, s.view(-1, 1), x


def _flatten_replace(x1, x2, gamma, eps):
    q, _, x, s, _ = npu.npu_add_rms_norm_dynamic_quant(
        x1, x2, gamma, output_mask=[True, False], **_eps_kwargs(eps))
    return q.flatten(0, 1), s.view(-1, 1), x


def _cast(x1, x2, gamma, eps):
    """npu_add_rms_norm_cast's (y_cast, y, x)."""
    y_cast, y, _, x = npu.npu_add_rms_norm_cast(x1, x2, gamma, **_eps_kwargs(eps))
    return y_cast, y, x


def _search_view(x1, x2, gamma, eps):
    y, _, x = _arn(x1, x2, gamma, eps)
    return y, x, y.view(-1, y.size(-1)).to(torch.float32)


def _replace_view(x1, x2, gamma, eps):
    y_cast, y, x = _cast(x1, x2, gamma, eps)
    return y, x, y_cast.view(-1, y.size(-1))


def _search_cast(x1, x2, gamma, eps):
    y, _, x = _arn(x1, x2, gamma, eps)
    return y, x, y.to(torch.float32)


def _replace_cast(x1, x2, gamma, eps):
    y_cast, y, x = _cast(x1, x2, gamma, eps)
    return y, x, y_cast


def _search_view_only(x1, x2, gamma, eps):  # y itself not used elsewhere
    return _search_view(x1, x2, gamma, eps)[1:]


def _replace_view_only(x1, x2, gamma, eps):
    return _replace_view(x1, x2, gamma, eps)[1:]


def _search_cast_only(x1, x2, gamma, eps):
    return _search_cast(x1, x2, gamma, eps)[1:]


def _replace_cast_only(x1, x2, gamma, eps):
    return _replace_cast(x1, x2, gamma, eps)[1:]


# --- registration -----------------------------------------------------------------------------


def _register(r, pairs, make_inputs, extra_check, generic_sizes: bool = False) -> None:
    """Every (search, replace) pair, for fp16 and bf16, with an explicit epsilon (a KeywordArg
    through scalar_workaround) and without one (the dispatcher drops the default)."""
    for dtype in HALF_DTYPES:
        inputs = make_inputs(dtype)
        for search, replace in pairs:
            r.replacement(search, replace, inputs, extra_check=extra_check,
                          scalar_workaround={"eps": EPS}, generic_sizes=generic_sizes)
            r.replacement(drop_eps(search), drop_eps(replace), inputs, extra_check=extra_check,
                          generic_sizes=generic_sizes)


def _norm_inputs(dtype, *, smooth: bool = False):
    """x1, x2 [2, 3, 4] (flatten(0, 1) needs 3 dims), gamma [4] (and smooth scales [4])."""
    return [empty(2, 3, 4, dtype=dtype), empty(2, 3, 4, dtype=dtype), empty(4, dtype=dtype),
            *([empty(4, dtype=dtype)] if smooth else [])]


@fusion_rule("torchair_add_rms_norm_dynamic_quant", stage="post_grad",
             doc="npu_add_rms_norm + npu_dynamic_quant([smooth_scales]) "
                 "-> npu_add_rms_norm_dynamic_quant")
def _register_a(r) -> None:
    _register(r, [(_quant_search, _quant_replace), (_quant_search_no_x, _quant_replace_no_x)],
              lambda dtype: _norm_inputs(dtype, smooth=True), _smooth_ok)
    _register(r, [(_plain_search, _plain_replace), (_plain_search_no_x, _plain_replace_no_x)],
              _norm_inputs, _fused_ok)


@fusion_rule("torchair_add_rms_norm_flatten_dynamic_quant", stage="post_grad",
             doc="npu_add_rms_norm + flatten(0,1) + npu_dynamic_quant + scale.view(-1,1) "
                 "-> npu_add_rms_norm_dynamic_quant")
def _register_b(r) -> None:
    _register(r, [(_flatten_search, _flatten_replace)], _norm_inputs, _flatten_ok,
              generic_sizes=True)


@fusion_rule("torchair_add_rms_norm_cast", stage="post_grad",
             doc="npu_add_rms_norm + [view(-1, h)] + to(float32) -> npu_add_rms_norm_cast")
def _register_c(r) -> None:
    _register(r, [(_search_view, _replace_view), (_search_cast, _replace_cast),
                  (_search_view_only, _replace_view_only), (_search_cast_only, _replace_cast_only)],
              _norm_inputs, _cast_ok, generic_sizes=True)
