"""torch_npu names that opennpu does not provide, each with the reason; the module
`__getattr__` of torch.npu and torch_npu.npu.utils raise an AttributeError naming them (an
AttributeError, so that `hasattr` probes by libraries still answer False)."""

from __future__ import annotations

_CANN = "it drives CANN or the Ascend driver, which do not exist off Ascend"
_LATER = "not implemented yet; see the torch.npu API table in docs/npu_device.md"

REASONS: dict[str, str] = {
    **dict.fromkeys([
        "set_aoe", "init_dump", "set_dump", "finalize_dump", "get_npu_overflow_flag",
        "clear_npu_overflow_flag", "npu_check_overflow", "stress_detect", "check_uce_in_memory",
        "stop_device", "restart_device", "set_device_limit",
        "get_device_limit", "set_stream_limit", "reset_stream_limit", "get_stream_limit",
        "obfuscation_initialize", "obfuscation_finalize", "obfuscation_calculate",
        "set_op_timeout_ms", "SyncLaunchStream", "utilization", "get_cann_version",
        "empty_virt_addr_cache", "mstx", "CubeMathType", "set_deterministic_level",
        "enable_deterministic_with_backward", "disable_deterministic_with_backward",
    ], _CANN),
    **dict.fromkeys([
        "ipc_collect", "MemPool", "MemPoolContext",
        "use_mem_pool", "NPUPluggableAllocator",
        "change_current_allocator",
    ], _LATER),
}


def missing(module: str, name: str) -> AttributeError:
    """The error for `module.name`: names torch_npu has say why opennpu lacks them."""
    reason = REASONS.get(name)
    if reason is None:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return AttributeError(f"{module}.{name} is not provided by opennpu ({reason})")
