"""A compiled training step on npu against the same compiled step on CPU, in one process.

    python -m benchmarks.compile_npu [--backend inductor|opennpu] [--repeats 10]

A small pre-norm decoder (RMSNorm, causal attention, SwiGLU MLP; 2 layers, d=256, 4x128 tokens)
is compiled with torch.compile (fullgraph; Inductor's C++ kernels on npu memory, or opennpu's
backend) on each device; a step is forward, backward and an AdamW step (eager, foreach). Steps
run interleaved, CPU and npu alternating, so both see the same machine load; the median of each
is kept. The npu steps' copies are counted (none expected) and the losses compared (equal up to
the order of the embedding backward's parallel atomic adds, which varies on either device).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import opennpu  # noqa: F401  (registers the npu device, also done by torch's autoload)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Layer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, 4 * d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, d=256, heads=4, layers=2, vocab=1000):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make_step(device: str, backend):
    torch.manual_seed(0)
    model = Decoder().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1000, (4, 128), generator=gen).to(device)
    labels = torch.randint(0, 1000, (4, 128), generator=gen).to(device)

    def step() -> float:
        loss = compiled(tokens, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def backend_for(name: str):
    if name == "opennpu":
        from opennpu.compile import CompilerConfig, get_npu_backend

        config = CompilerConfig()
        config.experimental_config.pattern_fusion_pass = True
        return get_npu_backend(compiler_config=config)
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "opennpu"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    steps, compile_s, losses = {}, {}, {}
    for device in ("cpu", "npu"):
        start = time.perf_counter()
        steps[device] = make_step(device, backend_for(args.backend))
        losses[device] = [steps[device](), steps[device]()]  # compiles, then a warm step
        compile_s[device] = time.perf_counter() - start

    times = {"cpu": [], "npu": []}
    copies_before = torch.ops.opennpu._npu_copy_stats()[0]
    copies = 0
    for _ in range(args.repeats):
        for device in ("cpu", "npu"):
            start = time.perf_counter()
            losses[device].append(steps[device]())
            times[device].append((time.perf_counter() - start) * 1e3)
            if device == "npu":
                copies = torch.ops.opennpu._npu_copy_stats()[0] - copies_before
    cpu, npu = statistics.median(times["cpu"]), statistics.median(times["npu"])
    # Not 0 in every run: the embedding's backward accumulates with atomic adds across threads.
    loss_diff = max(abs(a - b) / abs(a) for a, b in zip(losses["cpu"], losses["npu"]))
    print(f"compiled training step ({args.backend}, Decoder 2x256, 4x128 tokens, "
          f"{torch.get_num_threads()} threads): cpu {cpu:.1f} ms, npu {npu:.1f} ms, "
          f"npu/cpu {npu / cpu:.3f}x (medians of {args.repeats}); first two steps with compile: "
          f"cpu {compile_s['cpu']:.1f} s, npu {compile_s['npu']:.1f} s; copies made on npu: "
          f"{copies}; largest relative loss difference: {loss_diff:.1e}")


if __name__ == "__main__":
    main()
