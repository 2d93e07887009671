"""A DDP training step over 2 ranks on loopback: hccl on npu (the cross-rank mismatch check in
the launcher thread as by default, in the caller as with OPENNPU_HCCL_CHECK=sync, or none) against
gloo on CPU, steps interleaved in the same two processes.
python -m benchmarks.hccl_ddp [steps]

Prints, for each npu variant, the median over steps of the per-step time ratio npu/CPU (each npu
step next to a CPU step, so machine load hits both alike) and its interquartile range, plus the
same model stepped without DDP (the compute ceiling) and the collectives per step."""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _quartiles(v):
    q = statistics.quantiles(v, n=4)
    return q[0], statistics.median(v), q[2]


def _rank(rank: int, port: int, steps: int) -> None:
    import torch_npu  # noqa: F401
    import opennpu.distributed as hccl
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.npu.set_device(rank)
    dist.init_process_group("hccl", rank=rank, world_size=2)
    gloo = dist.new_group(backend="gloo")
    npu = torch.device("npu", rank)

    def make(device, group, ddp=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]).to(device)
        m = DDP(model, process_group=group) if ddp else model
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3), torch.randn(64, 512).to(device), torch.randn(64, 512).to(device)

    # (name, check, model, optimizer, x, y)
    runs = [("npu hccl", "1", *make(npu, None)), ("npu hccl, sync check", "sync", *make(npu, None)),
            ("npu hccl, no check", "0", *make(npu, None)),
            ("cpu gloo", "0", *make("cpu", gloo)),
            ("npu no DDP", "0", *make(npu, None, False)), ("cpu no DDP", "0", *make("cpu", None, False))]
    calls = [0]
    allreduce = hccl.ProcessGroupHCCL.allreduce

    def counting(self, *args):
        calls[0] += 1
        return allreduce(self, *args)

    hccl.ProcessGroupHCCL.allreduce = counting
    times = {r[0]: [] for r in runs}
    for i in range(steps + 2):
        for name, check, m, opt, x, y in runs:
            hccl._CHECK, hccl._DEFERRED = check != "0", check == "1"
            dist.barrier(group=gloo)
            calls[0] = 0
            start = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
            if name == "npu hccl":
                per_step = calls[0]
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"DDP step (4x Linear 512, batch 64/rank, AdamW), 2 ranks, 1 thread each, {steps} steps, "
              f"{per_step} allreduce(s) per step; medians: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()))
        for name, ref in (("npu hccl", "cpu gloo"), ("npu hccl, sync check", "cpu gloo"),
                          ("npu hccl, no check", "cpu gloo"), ("npu no DDP", "cpu no DDP")):
            q1, q2, q3 = _quartiles([a / b for a, b in zip(times[name], times[ref])])
            print(f"  {name} / {ref}: per-step time ratio median {q2:.3f} (IQR {q1:.3f}-{q3:.3f})")
    dist.destroy_process_group()


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, steps), nprocs=2)


if __name__ == "__main__":
    main()
