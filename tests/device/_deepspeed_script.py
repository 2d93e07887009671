"""A small DeepSpeed training script for test_deepspeed.py (one JSON line per process).
argv[1]: the ZeRO stage."""

import json
import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

accelerator = get_accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
config = {"train_batch_size": 8 * int(os.environ.get("WORLD_SIZE", "1")),
          "train_micro_batch_size_per_gpu": 8,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
          "zero_optimization": {"stage": int(sys.argv[1])}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
generator = torch.Generator().manual_seed(1)
x, y = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
x, y = x.to(engine.device), y.to(engine.device)
losses = []
for _ in range(3):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
print(json.dumps({"accelerator": accelerator.device_name(), "backend": accelerator.communication_backend_name(),
                  "device": str(engine.device), "losses": losses}))
