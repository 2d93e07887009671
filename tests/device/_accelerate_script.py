"""A small accelerate training script, run by test_accelerate.py in fresh processes (accelerate's
state is a per-process singleton). argv[1]: "npu" (accelerate picks the device) or "cpu"
(Accelerator(cpu=True)). Prints one JSON line per process.

The work runs in main() and the process group is destroyed after it, as scripts are told to end:
a process that reaches interpreter finalisation while a gloo worker still holds its last
collective can abort after its last line ("terminate called without an active exception",
pytorch/pytorch#190489; gloo on CPU without opennpu as well, see docs/distributed.md). Releasing
the script's tensors and the group first leaves the worker time to let go; it narrows that
window, it cannot close it (only gloo can)."""

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import is_npu_available


def main():
    accelerator = Accelerator(cpu=sys.argv[1] == "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weight = accelerator.unwrap_model(model)[0].weight.detach().reshape(1, -1)
    gathered = accelerator.gather(weight)  # every rank's copy, stacked
    print(json.dumps({
        "npu_available": is_npu_available(), "device": str(accelerator.device),
        "distributed_type": str(accelerator.distributed_type), "param_device": str(weight.device),
        "batch_device": str(x.device), "losses": losses,
        "replicas_equal": bool((gathered == gathered[0]).all()), "replicas": gathered.shape[0],
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
    }))


main()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
