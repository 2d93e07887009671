"""Tiny regression training, written for CUDA (golden input of opennpu.migrate).

Runs on npu:0 when a GPU is there; `--device cpu` forces the CPU.
"""
import argparse

import torch_npu
import torch
import torch.nn as nn
import torch.nn.functional as F

import os
DEVICE_ID = int(os.environ.get('DEVICE_ID', '0'))  # the NPU of this process (inserted by opennpu.migrate)
if torch_npu.npu.current_device() != DEVICE_ID:
    torch_npu.npu.set_device(f'npu:{DEVICE_ID}')

import torch.distributed
RANK_ID = int(os.environ.get('RANK_ID', str(DEVICE_ID)))
RANK_SIZE = int(os.environ.get('RANK_SIZE', '1'))
torch.distributed.init_process_group('hccl', rank=RANK_ID, world_size=RANK_SIZE)


class MLP(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--device', default='npu' if torch.npu.is_available() else 'cpu')
    parser.add_argument('--steps', type=int, default=5)
    args = parser.parse_args()
    device = torch.device(f'npu:{DEVICE_ID}')
    torch.manual_seed(0)
    if torch.npu.is_available():
        torch.npu.manual_seed_all(0)  # seed every cuda device
    model = MLP().to(f'npu:{DEVICE_ID}')
    model = model.npu()
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEVICE_ID], broadcast_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator).to(f'npu:{DEVICE_ID}')
    y = x.sum(dim=1, keepdim=True).to(f'npu:{DEVICE_ID}')
    scale = torch.ones(1, device=f'npu:{device}' if isinstance(device, int) else device)
    for step in range(args.steps):
        loss = F.mse_loss(model(x), y) * scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if x.is_npu:
            torch.npu.synchronize()
        print(f'step {step} loss {loss.item()!r} on {x.device.type}')


if __name__ == '__main__':
    main()
