"""The one tolerance table used by every test (and the demo's pass/fail column).

Kernels compute in float32 and round once, so their error against a float32 reference is at most
about one rounding of the output dtype; the table allows a few units of that.
"""

from __future__ import annotations

import torch

# dtype -> (atol, rtol)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-5, 1.3e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 scale: float = 1.0, msg: str = "") -> None:
    """Compare in float64 with the table's (atol, rtol) for `dtype` (default: actual's dtype),
    both multiplied by `scale` (for outputs that sum many rounded terms, e.g. weight gradients)."""
    atol, rtol = tolerance(dtype or actual.dtype)
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol * scale,
                               rtol=rtol * scale, equal_nan=True, msg=msg or None)
