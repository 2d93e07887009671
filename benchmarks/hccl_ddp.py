"""A DDP training step over 2 ranks on loopback: hccl on npu against gloo on CPU, steps interleaved
in the same two processes. python -m benchmarks.hccl_ddp [steps]"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, steps: int) -> None:
    import torch_npu  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.npu.set_device(rank)
    dist.init_process_group("hccl", rank=rank, world_size=2)
    gloo = dist.new_group(backend="gloo")
    runs = {}
    for name, device, group in (("npu hccl", torch.device("npu", rank), None), ("cpu gloo", torch.device("cpu"), gloo)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]).to(device)
        ddp = DDP(model, process_group=group)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        x, y = torch.randn(64, 512).to(device), torch.randn(64, 512).to(device)
        runs[name] = (ddp, opt, x, y)
    times = {k: [] for k in runs}
    for i in range(steps + 2):
        for name, (ddp, opt, x, y) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"DDP step (4x Linear 512, batch 64/rank, AdamW), 2 ranks, 1 thread each, medians of {steps}: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
              + f"; npu/cpu time {med['npu hccl'] / med['cpu gloo']:.3f}")
    dist.destroy_process_group()


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, steps), nprocs=2)


if __name__ == "__main__":
    main()
