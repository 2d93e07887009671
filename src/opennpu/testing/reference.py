"""Reference implementations (pure torch) of opennpu's ops.

Two kinds of function live here:
- `<op>(...)`: the oracle. Inputs are up-cast to float32 (float64 stays float64), the math follows
  the torch_npu contract, and outputs are returned in float32/float64 *without* rounding, so
  tests and benchmarks measure every implementation's error against the same exact-ish values.
- `native_<op>(...)`: the eager PyTorch code the seed documents show ("torch原生"), run in the
  input dtype. These are the baselines the fused ops replace (benchmarks, demo, accuracy bound).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _up(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


# ----------------------------------------------------------------------------- RMSNorm


def rms_norm(x, gamma, epsilon=1e-6):
    """(y, rstd): y = x * rstd * gamma over gamma's trailing dims; rstd keeps them as 1."""
    xf, gf = _up(x), _up(gamma)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return xf * rstd * gf, rstd


def gemma_rms_norm(x, gamma, epsilon=1e-6):
    return rms_norm(x, _up(gamma) + 1, epsilon)


def add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """(y, rstd, x): the sum is rounded to x1's dtype first, as torch_npu's golden does."""
    x = x1 + x2
    y, rstd = rms_norm(x, gamma, epsilon)
    return y, rstd, _up(x)


def rms_norm_backward(dy, x, gamma, rstd):
    """(dx, dgamma) from the contract's closed form."""
    dyf, xf, gf, rf = _up(dy), _up(x), _up(gamma), _up(rstd)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    lead = tuple(range(x.dim() - gamma.dim()))
    n = gamma.numel()
    dx = dyf * gf * rf - xf * rf.pow(3) * (dyf * gf * xf).sum(dim=dims, keepdim=True) / n
    dgamma = (dyf * xf * rf).sum(dim=lead) if lead else dyf * xf * rf
    return dx, dgamma


def native_rms_norm(x, weight, eps=1e-6):
    """Seed 000's TorchRMSNorm.forward."""
    output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return output.type_as(x) * weight


def native_add_rms_norm(x1, x2, weight, eps=1e-6):
    x = x1 + x2
    return native_rms_norm(x, weight, eps), x


# ----------------------------------------------------------------------------- activations


def _halves(x, dim):
    a, b = torch.chunk(_up(x), 2, dim=dim)
    return a, b


def swiglu(x, dim=-1):
    a, b = _halves(x, dim)
    return F.silu(a) * b


def swiglu_backward(grad, x, dim=-1):
    a, b = _halves(x, dim)
    g = _up(grad)
    s = torch.sigmoid(a)
    da = g * b * (s + a * s * (1 - s))
    db = g * a * s
    return torch.cat([da, db], dim=dim)


def native_swiglu(x, dim=-1):
    """Seed 000's TorchSwiGlu._swiglu."""
    x = torch.chunk(x, 2, dim)
    return F.silu(x[0]) * x[1]


def gelu(x, approximate=1):
    return F.gelu(x, approximate="tanh" if approximate == 1 else "none")


def geglu(x, dim=-1, approximate=1, activate_left=False):
    """(out, gelu_part): activate_left=False gives a * gelu(b), True gives gelu(a) * b."""
    a, b = _halves(x, dim)
    if activate_left:
        g = gelu(a, approximate)
        return g * b, g
    g = gelu(b, approximate)
    return a * g, g


def native_geglu(x, dim=-1, approximate=1, activate_left=False):
    a, b = torch.chunk(x, 2, dim)
    mode = "tanh" if approximate == 1 else "none"
    if activate_left:
        return F.gelu(a, approximate=mode) * b
    return a * F.gelu(b, approximate=mode)


def fast_gelu(x):
    """x * sigmoid(1.702 x) (= x / (1 + exp(-1.702 x)))."""
    xf = _up(x)
    return xf * torch.sigmoid(1.702 * xf)


def fast_gelu_backward(grad, x):
    xf = _up(x)
    s = torch.sigmoid(1.702 * xf)
    return _up(grad) * (s + 1.702 * xf * s * (1 - s))


def native_fast_gelu(x):
    """The eager composition fast_gelu stands for."""
    return x * torch.sigmoid(1.702 * x)


def native_gelu(x):
    """Seed 000's 'torch原生' code for fast_gelu: nn.functional.gelu (a different function)."""
    return F.gelu(x)


# ----------------------------------------------------------------------------- rotary


def rotate(x, rotary_mode="half"):
    """rotate(x) of npu_rotary_mul: half cat(-x2, x1); interleave (-x[2i+1], x[2i])."""
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def rotate_transposed(g, rotary_mode="half"):
    """The adjoint of rotate: half cat(g2, -g1); interleave (g[2i+1], -g[2i])."""
    return -rotate(g, rotary_mode)


def rotary_mul(x, r1, r2, rotary_mode="half", rotate_matrix=None):
    xf, c, s = _up(x), _up(r1), _up(r2)
    rx = xf @ _up(rotate_matrix) if rotate_matrix is not None else rotate(xf, rotary_mode)
    return xf * c + rx * s


def _reduce_to(t, shape):
    return t.sum_to_size(shape)


def rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    g, xf, c, s = _up(grad), _up(x), _up(r1), _up(r2)
    dx = _reduce_to(g * c, x.shape) + _reduce_to(rotate_transposed(g * s, rotary_mode), x.shape)
    dr1 = _reduce_to(xf * g, r1.shape)
    dr2 = _reduce_to(rotate(xf, rotary_mode) * g, r2.shape)
    return dx, dr1, dr2


def native_rotary_mul(x, r1, r2):
    """Seed 000's torch_func for npu_rotary_mul ('half' mode)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    x_new = torch.cat((-x2, x1), dim=-1)
    return r1 * x + r2 * x_new


# ----------------------------------------------------------------------------- scaled masked softmax

MASK_FILL = -10000.0  # torch_npu's golden fills masked positions with -10000, not -inf


def triu_mask(x):
    """fixed_triu_mask's mask over x's last two dims: True (masked) where column j > row i."""
    h, w = x.shape[-2:]
    return torch.ones(h, w, dtype=torch.bool, device=x.device).triu(diagonal=1)


def _softmax_mask(x, mask, fixed_triu_mask):
    return triu_mask(x) if fixed_triu_mask else mask.bool()


def scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False):
    """softmax((x * scale).masked_fill(mask, -10000), dim=-1); mask True (nonzero) = masked out."""
    s = (_up(x) * scale).masked_fill(_softmax_mask(x, mask, fixed_triu_mask), MASK_FILL)
    return torch.softmax(s, dim=-1)


def scaled_masked_softmax_backward(y_grad, y, mask, scale, fixed_triu_mask=False):
    """scale * y * (dy - sum_last(dy * y)), zero at masked positions."""
    dy, yf = _up(y_grad), _up(y)
    dx = scale * yf * (dy - (dy * yf).sum(dim=-1, keepdim=True))
    return dx.masked_fill(_softmax_mask(y, mask, fixed_triu_mask), 0.0)


def native_scaled_masked_softmax(x, mask, scale=1.0):
    """Seed 000's 'torch原生' code for npu_scaled_masked_softmax (-inf fill: NaN rows where the
    mask covers a whole row, unlike torch_npu's -10000)."""
    return torch.softmax((x * scale).masked_fill(mask, -1 * torch.inf), dim=-1)


def native_scaled_masked_softmax_golden(x, mask, scale=1.0):
    """The contract's composition (torch_npu's golden, -10000 fill) in the input dtype."""
    return torch.softmax((x * scale).masked_fill(mask, MASK_FILL), dim=-1)
