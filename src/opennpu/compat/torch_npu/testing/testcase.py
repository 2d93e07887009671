"""`torch_npu.testing.testcase`: the TestCase and run_tests that torch_npu's tests use.

assertRtolEqual follows Ascend's acceptance rule: with tolerance `tol` (prec, or prec16 for
float16), an element fails the absolute test when |x - y| > tol and the relative test when
|x - y| / (max(|x|, |y|) + tiny) > tol; the comparison fails only when more than tol * numel
elements fail the absolute test AND more than tol * numel fail the relative test. NaNs must sit
at the same places; equal infinities match.
"""

from __future__ import annotations

import os
import random
import sys
import unittest
from collections import OrderedDict
from collections.abc import Sequence
from numbers import Number

import numpy as np
import torch

from .common_utils import is_iterable, iter_indices, set_npu_device

try:  # assertExpectedInline, as in torch_npu's harness
    from expecttest import TestCase as _Base
except ImportError:  # pragma: no cover - expecttest is a test dependency
    _Base = unittest.TestCase

__all__ = ["TestCase", "run_tests"]

# The integer and floating numpy dtypes that assertRtolEqual compares (complex is not).
_RTOL_DTYPES = (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64, np.float16,
                np.float32, np.float64)
_TINY, _TINY16 = 1e-9, 6e-8
_CHUNK = 1 << 22  # elements compared per float64 chunk


def run_tests() -> None:
    """Runs the calling module's tests with unittest's command line (`python test_x.py -k ...`)."""
    unittest.main(argv=sys.argv)


def _as_numpy(value, dtype_of=None) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.numpy()
    if isinstance(value, Number):
        return np.array(value)
    return np.asarray(value)


class TestCase(_Base):
    """unittest TestCase with torch_npu's comparison helpers; seeds torch, random and numpy with
    $SEED (default 666) before each test and makes get_npu_device() current for the class."""

    _precision = 1e-5
    maxDiff = None
    exact_dtype = False

    @property
    def precision(self) -> float:
        return self._precision

    @precision.setter
    def precision(self, prec: float) -> None:
        self._precision = prec

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.npu_device = set_npu_device()

    def setUp(self) -> None:
        super().setUp()
        seed = int(os.environ.get("SEED", "666"))
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)

    # ---- assertRtolEqual -------------------------------------------------------------------

    def assertRtolEqual(self, x, y, prec=1.e-4, prec16=1.e-3, auto_trans_dtype=False,
                        message=None):
        """x and y agree within Ascend's tolerance (module docstring): tensors on any device,
        numpy arrays, numbers, or sequences of them compared pairwise. bfloat16 pairs are compared
        with allclose(rtol=atol=prec16); `auto_trans_dtype` first casts x to y's dtype."""
        note = f": {message}" if message else ""
        if isinstance(x, Sequence) and isinstance(y, Sequence) and not isinstance(x, str):
            if len(x) != len(y):
                self.fail(f"assertRtolEqual: lengths differ, {len(x)} vs {len(y)}{note}")
            for xi, yi in zip(x, y):
                self.assertRtolEqual(xi, yi, prec, prec16, auto_trans_dtype, message)
            return
        if isinstance(x, torch.Tensor) and isinstance(y, Sequence):
            y = torch.as_tensor(y, dtype=x.dtype)
        elif isinstance(x, Sequence) and isinstance(y, torch.Tensor):
            x = torch.as_tensor(x, dtype=y.dtype)

        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if auto_trans_dtype:
                x = x.to(y.dtype)
            if tuple(x.shape) != tuple(y.shape):
                self.fail(f"assertRtolEqual: shape error, {tuple(x.shape)} vs "
                          f"{tuple(y.shape)}{note}")
            if x.dtype != y.dtype:
                self.fail(f"assertRtolEqual: dtype error, {x.dtype} vs {y.dtype}{note}")
            if x.dtype == torch.bfloat16:
                if not torch.allclose(x.detach().cpu(), y.detach().cpu(), rtol=prec16,
                                      atol=prec16, equal_nan=True):
                    self.fail(f"assertRtolEqual: bfloat16 results differ beyond {prec16}{note}")
                return

        xa, ya = _as_numpy(x), _as_numpy(y)
        if xa.shape != ya.shape:
            self.fail(f"assertRtolEqual: shape error, {xa.shape} vs {ya.shape}{note}")
        if xa.dtype != ya.dtype:
            self.fail(f"assertRtolEqual: dtype error, {xa.dtype} vs {ya.dtype}{note}")
        if xa.dtype.type not in _RTOL_DTYPES:
            self.fail(f"assertRtolEqual: dtype {xa.dtype} is not compared; expected one of "
                      f"{[d.__name__ for d in _RTOL_DTYPES]}{note}")
        if xa.dtype == np.bool_:
            if not np.array_equal(xa, ya):
                self.fail(f"assertRtolEqual: boolean results differ{note}")
            return
        tol, tiny = (prec16, _TINY16) if xa.dtype == np.float16 else (prec, _TINY)
        xs, ys = xa.reshape(-1), ya.reshape(-1)
        abs_bad = rel_bad = 0
        worst, worst_rel = 0, -1.0
        # in float64 chunks: a multi-GiB cache (op-plugin's reshape_and_cache int8 case) must not
        # become one float64 copy of itself
        for lo in range(0, max(xs.size, 1), _CHUNK):
            xf, yf = xs[lo:lo + _CHUNK].astype(np.float64), ys[lo:lo + _CHUNK].astype(np.float64)
            nan = np.isnan(xf)
            if not np.array_equal(nan, np.isnan(yf)):
                self.fail(f"assertRtolEqual: NaNs at different places{note}")
            same = nan | (xf == yf)  # also equal infinities, whose difference is NaN
            with np.errstate(invalid="ignore"):
                err = np.where(same, 0.0, np.abs(xf - yf))
                rel = err / (np.maximum(np.abs(xf), np.abs(yf)) + tiny)
            err, rel = np.nan_to_num(err, nan=np.inf), np.nan_to_num(rel, nan=np.inf)
            abs_bad += int((err > tol).sum())
            rel_bad += int((rel > tol).sum())
            if rel.size and rel.max() > worst_rel:
                worst, worst_rel = lo + int(np.argmax(rel)), float(rel.max())
        allowed = xa.size * tol
        if abs_bad > allowed and rel_bad > allowed:
            at = np.unravel_index(worst, xa.shape) if xa.ndim else ()
            self.fail(f"assertRtolEqual: result error, {abs_bad} of {xa.size} elements beyond "
                      f"absolute tolerance {tol} and {rel_bad} beyond relative tolerance; worst at "
                      f"{tuple(int(i) for i in at)}: {float(xs[worst])} vs {float(ys[worst])}"
                      f"{note}")

    # ---- assertEqual -----------------------------------------------------------------------

    def assertEqual(self, x, y, prec=None, message="", allow_inf=False, exact_dtype=None):
        """Tolerant equality: tensors (any device, compared on the CPU) and numpy arrays agree
        when the sizes match and the largest |x - y| is at most `prec` (default self.precision)
        with NaNs (and, with allow_inf, infinities) at the same places; numbers likewise;
        dicts, lists and tuples element by element; anything else with ==. A string `prec` is
        taken as the message."""
        if isinstance(prec, str) and not message:
            prec, message = None, prec
        if prec is None:
            prec = self.precision
        if exact_dtype is None:
            exact_dtype = self.exact_dtype
        self._assert_equal(x, y, prec, message or "", allow_inf, exact_dtype)

    def _assert_equal(self, x, y, prec, message, allow_inf, exact_dtype):
        base_equal = super().assertEqual
        if isinstance(x, np.ndarray) and isinstance(y, (np.ndarray, torch.Tensor)):
            x = torch.from_numpy(np.ascontiguousarray(x))
        if isinstance(y, np.ndarray) and isinstance(x, torch.Tensor):
            y = torch.from_numpy(np.ascontiguousarray(y))
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            self._assert_tensors_equal(x, y, prec, message, allow_inf, exact_dtype)
        elif isinstance(x, (Number, np.number, torch.Tensor)) and \
                isinstance(y, (Number, np.number, torch.Tensor)):
            self._assert_numbers_equal(x, y, prec, message, allow_inf)
        elif isinstance(x, (np.bool_, bool)) or isinstance(y, (np.bool_, bool)):
            base_equal(bool(x.item() if isinstance(x, torch.Tensor) else x),
                       bool(y.item() if isinstance(y, torch.Tensor) else y), message)
        elif isinstance(x, (str, bytes)) or isinstance(y, (str, bytes)) or \
                (isinstance(x, (set, frozenset)) and isinstance(y, (set, frozenset))):
            base_equal(x, y, message)
        elif isinstance(x, dict) and isinstance(y, dict):
            if isinstance(x, OrderedDict) and isinstance(y, OrderedDict):
                base_equal(list(x.keys()), list(y.keys()), message)
            else:
                base_equal(set(x.keys()), set(y.keys()), message)
            for key in x:
                self._assert_equal(x[key], y[key], prec, message, allow_inf, exact_dtype)
        elif is_iterable(x) and is_iterable(y):
            x, y = list(x), list(y)
            base_equal(len(x), len(y), message)
            for xi, yi in zip(x, y):
                self._assert_equal(xi, yi, prec, message, allow_inf, exact_dtype)
        else:
            base_equal(x, y, message)

    def _assert_numbers_equal(self, x, y, prec, message, allow_inf):
        if isinstance(x, torch.Tensor):
            x = x.item()
        if isinstance(y, torch.Tensor):
            y = y.item()
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            x, y = np.asarray(x).item(), np.asarray(y).item()
        if abs(x) == float("inf") or abs(y) == float("inf"):
            if not allow_inf:
                self.fail(f"Expected finite numeric values - x={x}, y={y}. {message}")
            super().assertEqual(x, y, message)
            return
        if x != x or y != y:  # NaN equals NaN here, as for tensors
            self.assertTrue(x != x and y != y, f"{x} vs {y}. {message}")
            return
        self.assertLessEqual(abs(x - y), prec, message)

    def _assert_tensors_equal(self, x, y, prec, message, allow_inf, exact_dtype):
        super().assertEqual(x.size(), y.size(), message)
        if exact_dtype:
            super().assertEqual(x.dtype, y.dtype, message)
        if x.is_sparse or y.is_sparse:
            x, y = x.to_dense(), y.to_dense()
        if x.numel() == 0:
            return
        x, y = x.detach().cpu(), y.detach().cpu()
        if (x.dtype == torch.bool) != (y.dtype == torch.bool):
            raise TypeError("assertEqual: was expecting both tensors to be bool type, got "
                            f"{x.dtype} and {y.dtype}")
        wide = torch.complex128 if (x.is_complex() or y.is_complex()) else torch.float64
        xw, yw = x.to(wide), y.to(wide)
        diff = xw - yw
        if wide == torch.float64 or x.is_complex():
            nan = torch.isnan(xw)
            self.assertTrue(torch.equal(nan, torch.isnan(yw)),
                            f"NaNs at different places. {message}")
            diff[nan] = 0
            inf = torch.isinf(xw)
            if allow_inf:
                self.assertTrue(torch.equal(xw[inf], yw[inf]) and
                                torch.equal(inf, torch.isinf(yw)),
                                f"infinities differ. {message}")
                diff[inf] = 0
        max_err = diff.abs().max().item()
        self.assertLessEqual(max_err, prec, message)

    def assertNotEqual(self, x, y, prec=None, message=""):
        """The opposite of assertEqual, with the same tolerance."""
        try:
            self.assertEqual(x, y, prec, message)
        except (AssertionError, TypeError):  # TypeError: values that cannot be compared
            return
        self.fail(f"assertNotEqual: {x!r} and {y!r} are equal within the tolerance. {message}")

    def assertAlmostEqual(self, x, y, places=None, msg=None, delta=None, allow_inf=None):
        prec = 10 ** (-places) if places else delta
        self.assertEqual(x, y, prec, msg or "", bool(allow_inf))

    def assertTensorsSlowEqual(self, x, y, prec=None, message=""):
        """Element-by-element comparison: same size and dtype, max |x - y| at most prec."""
        super().assertEqual(x.size(), y.size(), message)
        super().assertEqual(x.dtype, y.dtype, message)
        if x.dtype == torch.bool:
            self.assertEqual(x, y, message=message)
            return
        y = y.to(x.device)
        worst = max((abs((x[i] - y[i]).item()) for i in iter_indices(x)), default=0)
        self.assertLessEqual(worst, prec if prec is not None else self.precision, message)
