"""Distributed mixed-precision training of TinyGPT on cuda:LOCAL_RANK with NCCL."""
import os

import amp_C  # apex's multi-tensor kernels
import torch
import torch.distributed as dist
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from gpt_tiny import TinyGPT


def setup():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dist.init_process_group(backend="nccl")
    if dist.get_backend() == "nccl":
        torch.backends.cudnn.benchmark = True
    torch.cuda.set_device(local_rank)
    return local_rank


def main():
    local_rank = setup()
    model = TinyGPT().cuda(local_rank)
    if torch.cuda.device_count() > 1 and not dist.is_initialized():
        model = torch.nn.DataParallel(model)
    model = DDP(model, device_ids=[local_rank])
    major, _ = torch.cuda.get_device_capability()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler()
    tokens = torch.randint(0, 64, (4, 16), device=local_rank)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        for _ in range(3):
            with autocast(dtype=torch.float16 if major >= 7 else torch.float32):
                logits = model(tokens.to(local_rank))
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    print(f"rank {dist.get_rank()} on cuda:{local_rank}: loss {loss.item():.4f}")
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
