"""Run in a subprocess by test_transfer_to_npu.py: without TORCH_NPU_MIGRATION_LOG the log is off;
`_unpatch()` restores every patched object. Prints "UNPATCH ok" or raises. (The per-call cost of
the patches is measured by benchmarks/transfer_overhead.py, not here.)"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parameter import UninitializedTensorMixin

import opennpu.migrate.transfer as transfer


def snapshot():
    return {
        "zeros": torch.zeros, "to": vars(torch.Tensor).get("to"), "cuda": vars(torch.Tensor).get("cuda"),
        "is_cuda": vars(torch.Tensor).get("is_cuda"), "module_cuda": torch.nn.Module.cuda,
        "is_available": torch.cuda.is_available, "Stream": torch.cuda.Stream,
        "Generator": torch.Generator, "Event": torch.Event, "script": torch.jit.script,
        "init_process_group": dist.init_process_group, "nccl": dist.is_nccl_available,
        "autocast_init": torch.amp.autocast_mode.autocast.__init__,
        "amp_autocast": torch.cuda.amp.autocast, "GradScaler": torch.cuda.amp.GradScaler,
        "allowed": list(UninitializedTensorMixin._allowed_methods),
        "backend_map": dict(dist.Backend.default_device_backend_map),
        "meta_path": list(sys.meta_path), "get_rng_state": torch.cuda.get_rng_state,
    }


def main():
    before = snapshot()
    transfer.apply()
    assert transfer.is_applied() and transfer._log is None
    assert torch.zeros is not before["zeros"] and torch.cuda.is_available is torch.npu.is_available
    assert torch.ones(2).to(torch.float64).dtype == torch.float64
    transfer.apply()  # idempotent
    transfer._unpatch()
    after = snapshot()
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, changed
    assert not transfer.is_applied()
    assert torch.zeros(1).device.type == "cpu"
    print("UNPATCH ok")


if __name__ == "__main__":
    main()
