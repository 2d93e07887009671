"""Test parametrization of torch_npu's harness: `@Dtypes(...)` and `@Formats(...)` mark a test
method, and `@instantiate_tests` on the class replaces it by one method per combination,
named `<test>_<dtype>_<format>` (e.g. test_add_float16_2)."""

from __future__ import annotations

import functools
import inspect
import itertools

import torch

__all__ = ["Dtypes", "Formats", "instantiate_tests"]


class Dtypes:
    """Runs the decorated test once per torch dtype given."""

    def __init__(self, *dtypes: torch.dtype):
        if not dtypes:
            raise RuntimeError("Dtypes: no dtypes given")
        bad = [d for d in dtypes if not isinstance(d, torch.dtype)]
        if bad:
            raise RuntimeError(f"Dtypes: expected torch dtypes, got {bad!r}")
        self.args = dtypes

    def __call__(self, fn):
        fn.dtypes = self.args
        return fn


class Formats:
    """Runs the decorated test once per npu format given (ints of torch_npu's ACL formats)."""

    def __init__(self, *formats):
        if not formats:
            raise RuntimeError("Formats: no formats given")
        self.args = formats

    def __call__(self, fn):
        fn.formats = self.args
        return fn


def _parameter_for(key: str, params: list[str], test_name: str) -> str:
    """The test's parameter whose name contains `key` ("dtype" matches `npu_dtype`)."""
    matches = [p for p in params if key in p]
    if len(matches) != 1:
        raise RuntimeError(f"instantiate_tests: {test_name} needs exactly one parameter whose name "
                           f"contains {key!r}, found {matches}")
    return matches[0]


def _bind(fn, name: str, kwargs: dict):
    @functools.wraps(fn)
    def test(self):
        return fn(self, **kwargs)

    test.__name__ = test.__qualname__ = name
    return test


def instantiate_tests(cls=None, **_unused):
    """Class decorator expanding the @Dtypes / @Formats tests of `cls`; a test taking a `device`
    parameter gets device="npu"."""

    def expand(cls):
        for name, fn in list(vars(cls).items()):
            axes = [(key, getattr(fn, attr)) for key, attr in (("dtype", "dtypes"),
                                                                ("format", "formats"))
                    if callable(fn) and hasattr(fn, attr)]
            if not axes:
                continue
            params = inspect.getfullargspec(fn).args
            base_kwargs = {"device": "npu"} if "device" in params else {}
            targets = [_parameter_for(key, params, name) for key, _ in axes]
            for combo in itertools.product(*(values for _, values in axes)):
                suffix = "".join("_" + (str(v).split(".")[-1] if key == "dtype" else str(v))
                                 for (key, _), v in zip(axes, combo))
                kwargs = dict(base_kwargs, **dict(zip(targets, combo)))
                setattr(cls, name + suffix, _bind(fn, name + suffix, kwargs))
            delattr(cls, name)
        return cls

    return expand if cls is None else expand(cls)
