"""Tiny regression training, written for CUDA (golden input of opennpu.migrate).

Runs on cuda:0 when a GPU is there; `--device cpu` forces the CPU.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--steps', type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(0)  # seed every cuda device
    model = MLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator).to(device)
    y = x.sum(dim=1, keepdim=True).to(device)
    scale = torch.ones(1, device=device)
    for step in range(args.steps):
        loss = F.mse_loss(model(x), y) * scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if x.is_cuda:
            torch.cuda.synchronize()
        print(f'step {step} loss {loss.item()!r} on {x.device.type}')


if __name__ == '__main__':
    main()
