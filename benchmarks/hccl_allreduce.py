"""all_reduce of 256 MiB over 2 ranks on loopback: hccl on npu tensors against gloo on CPU tensors,
interleaved in the same two processes. python -m benchmarks.hccl_allreduce [MiB] [reps]"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, mib: int, reps: int) -> None:
    import torch_npu  # noqa: F401

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.npu.set_device(rank)
    dist.init_process_group("hccl", rank=rank, world_size=2)
    gloo = dist.new_group(backend="gloo")
    n = mib * (1 << 20) // 4
    npu, cpu = torch.ones(n, device=f"npu:{rank}"), torch.ones(n)
    times = {"npu hccl": [], "cpu gloo": []}
    for i in range(reps + 1):
        for name, t, g in (("npu hccl", npu, None), ("cpu gloo", cpu, gloo)):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t, group=g)
            if i:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"all_reduce {mib} MiB, 2 ranks, medians of {reps}: " +
              ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()) +
              f"; npu/cpu time {med['npu hccl'] / med['cpu gloo']:.3f}")
    dist.destroy_process_group()


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, mib, reps), nprocs=2)


if __name__ == "__main__":
    main()
