"""A small training program written for CUDA (`.cuda()`, "cuda:0", torch.cuda.amp, GradScaler,
torch.cuda.synchronize, pinned DataLoader, cudnn.benchmark), runnable on CPU with device="cpu".

`python cuda_training.py` runs it on CPU (fp32 and bf16 autocast), then under transfer_to_npu with
device="cuda", and prints one JSON object with the four loss lists.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 8 * 8, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def train(device: str, amp: bool, steps_per_epoch: int = 4, epochs: int = 2) -> list[float]:
    """Losses of each step; `device` is "cuda" (the program as written for a GPU) or "cpu"."""
    cuda = device == "cuda"
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    images = torch.randn(steps_per_epoch * 16, 1, 16, 16)
    labels = torch.randint(0, 10, (steps_per_epoch * 16,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels),
                                         batch_size=16, shuffle=True, pin_memory=cuda,
                                         generator=torch.Generator().manual_seed(0))
    model = Net()
    model = model.cuda() if cuda else model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    if cuda:
        scaler = torch.cuda.amp.GradScaler(enabled=amp)
    else:
        scaler = torch.amp.GradScaler("cpu", enabled=amp)
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            if cuda:
                x, y = x.cuda(non_blocking=True), y.to("cuda:0", non_blocking=True)
                autocast = torch.cuda.amp.autocast(enabled=amp, dtype=torch.bfloat16)
            else:
                autocast = torch.autocast("cpu", enabled=amp, dtype=torch.bfloat16)
            with autocast:
                loss = F.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if cuda:
                torch.cuda.synchronize()
            losses.append(loss.item())
    return losses


def main():
    result = {"cpu_fp32": train("cpu", amp=False), "cpu_bf16": train("cpu", amp=True)}
    from torch_npu.contrib import transfer_to_npu  # noqa: F401

    result["cuda_fp32"] = train("cuda", amp=False)
    result["cuda_bf16"] = train("cuda", amp=True)
    print("LOSSES " + json.dumps(result))


if __name__ == "__main__":
    main()
