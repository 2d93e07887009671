"""Seed 001's manual migration, run as written on a machine without Ascend hardware.

The training script below is the CUDA script of seed 001 with the documented replacements
("cuda:0" -> "npu:0", torch.cuda.* -> torch.npu.*, torch.cuda.amp -> torch.npu.amp), followed by
its second AMP route (Ascend's apex). opennpu's npu device keeps tensors in host memory and runs
every op with the CPU's kernels, so the fp32 run gives bit-for-bit the losses of the same model
on the CPU, which the script checks.

    python examples/seed001_manual_migration.py
"""

from __future__ import annotations

import torch

import torch_npu  # noqa: F401  (registers the npu device: torch.npu, "npu:0", Tensor.npu())


def make_model(in_size: int, out_size: int, num_layers: int) -> torch.nn.Module:
    layers = []
    for _ in range(num_layers - 1):
        layers += [torch.nn.Linear(in_size, in_size), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(in_size, out_size))
    return torch.nn.Sequential(*layers)


def train(device: torch.device, use_amp: bool, steps: int = 20) -> list[float]:
    torch.manual_seed(0)
    in_size, out_size, num_layers, batch = 64, 16, 3, 32
    # four fixed batches seen five times each, so the loss has something to learn
    data = [torch.randn(batch, in_size) for _ in range(4)] * (steps // 4)
    targets = [torch.randn(batch, out_size) for _ in range(4)] * (steps // 4)
    net = make_model(in_size, out_size, num_layers).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.MSELoss()
    scaler = torch.npu.amp.GradScaler(enabled=use_amp)
    losses = []
    for inp, target in zip(data, targets):
        inp, target = inp.to(device), target.to(device)
        with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=use_amp):
            output = net(inp)
            loss = loss_fn(output.float(), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    torch.npu.synchronize()
    return losses


def train_apex(steps: int = 20) -> list[float]:
    from apex import amp  # Ascend's apex fork (opennpu provides it when no apex is installed)

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 16).npu()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    x, y = torch.randn(32, 64).npu(), torch.randn(32, 16).npu()
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    device = torch.device("npu:0")
    torch.npu.set_device(device)
    print(f"device: {torch.npu.get_device_name(0)}, {torch.npu.device_count()} visible")
    npu_losses = train(device, use_amp=False)
    cpu_losses = train(torch.device("cpu"), use_amp=False)
    same = npu_losses == cpu_losses
    print(f"fp32, 20 steps: npu loss {npu_losses[0]:.5f} -> {npu_losses[-1]:.5f}; "
          f"bit-identical to the CPU run: {same}")
    amp_losses = train(device, use_amp=True)
    print(f"torch.npu.amp (fp16 autocast + GradScaler): loss {amp_losses[0]:.5f} -> "
          f"{amp_losses[-1]:.5f}")
    apex_losses = train_apex()
    print(f"apex O1: loss {apex_losses[0]:.5f} -> {apex_losses[-1]:.5f}")
    print(f"npu memory: {torch.npu.max_memory_allocated() / 2**10:.0f} KiB peak allocated")
    if not same:
        raise SystemExit("npu and CPU losses differ")


if __name__ == "__main__":
    main()
