"""Ascend-only switches of `torch.npu`, accepted so that Ascend scripts run unchanged.

Off Ascend they change no computation: opennpu runs ATen's CPU kernels in their own precision
(no HF32, no operator compilation, no private memory formats). Each switch validates its argument
as torch_npu does and records the value, which reads back:

- `torch.npu.config.allow_internal_format` (bool, default False): whether ops may pick Ascend's
  private layouts (NZ, 5HD). opennpu keeps every tensor in its logical (ND) layout.
- `torch.npu.matmul.allow_hf32` (default False), `torch.npu.conv.allow_hf32` (default True):
  HiFloat32 for fp32 matmul / convolution on the Cube unit. CPU kernels compute in fp32.
- `torch.npu.aclnn.allow_hf32`: the same switch as `torch.npu.conv.allow_hf32`, under torch_npu's
  aclnn namespace; `torch.npu.aclnn.version()` is None (with a warning), as torch_npu answers.
- `torch.npu.use_compatible_impl(bool)`, `are_compatible_impl_enabled()` (default False): whether
  ops use implementations whose results match PyTorch's. Every op here is PyTorch's CPU kernel or
  written against it, so the switch is recorded only.
- `torch.npu.set_compile_mode(jit_compile=False)`, `is_jit_compile_false()`: CANN's just-in-time
  operator compilation. No operator is compiled here.
- `torch.npu.set_option(dict)`: CANN session options (ACL_PRECISION_MODE, ...); values are checked
  against CANN's allowed sets and recorded as strings.
- `torch.npu.set_mm_bmm_format_nd(bool)`, `get_mm_bmm_format_nd()`: ND output of mm/bmm, which is
  the only layout here.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

__all__ = ["aclnn", "are_compatible_impl_enabled", "conv", "config", "get_mm_bmm_format_nd", "is_jit_compile_false", "matmul",
           "set_compile_mode", "set_mm_bmm_format_nd", "set_option", "use_compatible_impl"]

# The values CANN accepts for the options it checks; None: any value.
_OPTION_VALUES: dict[str, list[str] | Callable[[str], bool] | None] = {
    "ACL_PRECISION_MODE": ["allow_fp32_to_fp16", "must_keep_origin_dtype"],
    "ACL_OP_SELECT_IMPL_MODE": ["high_performance", "high_precision"],
    "ACL_AICORE_NUM": lambda v: v.isdigit() and 1 <= int(v) <= 32,
    "ACL_OPTYPELIST_FOR_IMPLMODE": None,
    "ACL_OP_DEBUG_LEVEL": ["0", "1", "2", "3", "4"],
    "ACL_DEBUG_DIR": None,
    "ACL_OP_COMPILER_CACHE_MODE": ["disable", "enable", "force"],
    "ACL_OP_COMPILER_CACHE_DIR": None,
    "ACL_OP_DEBUG_OPTION": None,
}
_DEPRECATED_OPTIONS = {"ACL_OP_SELECT_IMPL_MODE", "ACL_OPTYPELIST_FOR_IMPLMODE"}

# Every option set so far, as strings; the switches below read their state from here.
_options: dict[str, str] = {}


def _get_option(name: str) -> str | None:
    return _options.get(name)


def _require_bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be a bool, but got {type(value).__name__} ({value!r})")
    return value


def set_option(option: dict) -> None:
    """Records CANN session options (no effect on the computation off Ascend); raises
    ValueError for a value CANN rejects."""
    if not isinstance(option, dict):
        raise TypeError(f"torch.npu.set_option: option must be a dict, got {type(option).__name__}")
    checked = {}
    for name, value in option.items():
        text = str(value)
        allowed = _OPTION_VALUES.get(name)
        if callable(allowed) and not allowed(text):
            raise ValueError(f"torch.npu.set_option: value of {name} must be an integer in 1..32, "
                             f"but got {value!r}")
        if isinstance(allowed, list) and text not in allowed:
            raise ValueError(f"torch.npu.set_option: value of {name} should be in {allowed} "
                             f"but got {value!r}")
        if name in _DEPRECATED_OPTIONS:
            warnings.warn(f"torch.npu.set_option: {name} will be deprecated in a future version",
                          stacklevel=2)
        checked[str(name)] = text
    _options.update(checked)


def set_compile_mode(jit_compile: bool = False) -> None:
    """Records CANN's jitCompile mode; nothing is compiled off Ascend."""
    _require_bool("torch.npu.set_compile_mode: jit_compile", jit_compile)
    _options["jitCompile"] = "enable" if jit_compile else "disable"


def is_jit_compile_false() -> bool:
    """True once set_compile_mode(jit_compile=False) (or the option) disabled jitCompile."""
    return _options.get("jitCompile") == "disable"


def set_mm_bmm_format_nd(is_nd: bool = True) -> None:
    _require_bool("torch.npu.set_mm_bmm_format_nd: is_nd", is_nd)
    _options["MM_BMM_ND_ENABLE"] = "enable" if is_nd else "disable"


def get_mm_bmm_format_nd() -> bool:
    return _options.get("MM_BMM_ND_ENABLE", "enable") == "enable"


def use_compatible_impl(is_enable: bool) -> None:
    """Records torch_npu's TORCH_NPU_USE_COMPATIBLE_IMPL option (module docstring); like
    torch_npu, any truthy `is_enable` enables it."""
    _options["TORCH_NPU_USE_COMPATIBLE_IMPL"] = "1" if is_enable else "0"


def are_compatible_impl_enabled() -> bool:
    return _options.get("TORCH_NPU_USE_COMPATIBLE_IMPL") == "1"


class _Switches:
    """Attributes backed by an option of `_options`: name -> (option, value when unset)."""

    _fields: dict[str, tuple[str, bool]] = {}
    _owner = ""

    def _unknown(self, name: str) -> AttributeError:
        return AttributeError(f"{self._owner}.{name} is not provided by opennpu (known switches: "
                              f"{sorted(self._fields)})")

    def __getattr__(self, name: str) -> bool:
        if name not in self._fields:
            raise self._unknown(name)
        option, default = self._fields[name]
        value = _options.get(option)
        return default if value is None else value == "enable"

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            raise self._unknown(name)
        _require_bool(f"{self._owner}.{name}", value)
        _options[self._fields[name][0]] = "enable" if value else "disable"

    def __repr__(self) -> str:
        values = ", ".join(f"{n}={getattr(self, n)}" for n in self._fields)
        return f"<{self._owner}: {values}>"


class _Config(_Switches):
    _fields = {"allow_internal_format": ("ALLOW_INTERNAL_FORMAT", False)}
    _owner = "torch.npu.config"


class _MatmulHF32(_Switches):
    _fields = {"allow_hf32": ("ALLOW_MATMUL_HF32", False)}
    _owner = "torch.npu.matmul"


class _ConvHF32(_Switches):
    _fields = {"allow_hf32": ("ALLOW_CONV_HF32", True)}
    _owner = "torch.npu.conv"


class _Aclnn(_Switches):
    _fields = {"allow_hf32": ("ALLOW_CONV_HF32", True)}
    _owner = "torch.npu.aclnn"

    @staticmethod
    def version() -> None:
        """The aclnn library's version: torch_npu does not report one (None, with a warning)."""
        warnings.warn("torch.npu.aclnn.version isn't implemented!", stacklevel=2)
        return None


config = _Config()
aclnn = _Aclnn()
matmul = _MatmulHF32()
conv = _ConvHF32()
