"""Random number generators of `torch.npu`.

Each device's default generator is an mt19937 engine (a CPU generator under the npu device): npu
random ops run their CPU kernels with it, so after `torch.manual_seed(s)` (which seeds every npu
device too) `torch.randn(n, device="npu")` draws the numbers `torch.randn(n)` draws on CPU.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from . import graphs as _graphs
from .device import _checked_index, device_count

__all__ = ["default_generators", "get_rng_state", "get_rng_state_all", "initial_seed",
           "manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state",
           "set_rng_state_all"]

# The same C++ generators as ATen's (hooks' getDefaultGenerator), one per visible device.
default_generators: tuple[torch.Generator, ...] = tuple(
    torch.ops.opennpu._npu_default_generator(i) for i in range(device_count()))


def _generator(device: Any = None) -> torch.Generator:
    return default_generators[_checked_index(device)]


def manual_seed(seed: int) -> None:
    """Seeds the current device's default generator (during a graph capture only with the seed
    it has)."""
    generator = _generator()
    _graphs._rng_seed_write(generator, seed)
    generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for generator in default_generators:
        _graphs._rng_seed_write(generator, seed)
        generator.manual_seed(int(seed))


def seed() -> None:
    """Seeds the current device's generator with a non-deterministic number."""
    _generator().seed()


def seed_all() -> None:
    value = _generator().seed()
    for generator in default_generators:
        generator.manual_seed(value)


def initial_seed() -> int:
    return _generator().initial_seed()


def get_rng_state(device: Any = "npu") -> torch.Tensor:
    """The generator state of `device` as a CPU ByteTensor (inside a graph capture, restoring it
    later in the capture rewinds each replay to this point: graphs.py)."""
    generator = _generator(device)
    state = generator.get_state()
    _graphs._rng_state_read(generator, state)
    return state


def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
    generator = _generator(device)
    state = new_state.clone() if new_state.device.type == "cpu" else new_state.cpu()
    _graphs._rng_state_write(generator, state)
    generator.set_state(state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(index) for index in range(len(default_generators))]


def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)

