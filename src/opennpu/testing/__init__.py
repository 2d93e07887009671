"""Shared oracles for tests and benchmarks: reference implementations, native baselines, tolerances."""

from . import reference, tolerances  # noqa: F401
