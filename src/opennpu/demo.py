"""`python -m opennpu demo`: the ops next to the native PyTorch code they replace, then a
training run, a compiled model and seed 001's loop on the npu device.

The op table is benchmarks/demo.py (`python -m benchmarks.demo` prints it alone): a few cases of
benchmarks/cases, so the demo's shapes, baselines and oracles are the benchmarks' own. It ships
with the source checkout, not with the wheel, so the table needs the repository (the directory
`python -m opennpu demo` runs from, or one above it); the sections below run anywhere.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import torch

from .testing.table import format_table
from .testing.timing import busy_warning, num_threads, reuse_freed_memory, time_fn


def _benchmarks_demo():
    """benchmarks.demo of the source checkout, or None outside one. `python -m` puts the current
    directory on sys.path; the `opennpu` script does not, so the checkout is also looked for in
    the current directory and those above it."""
    try:
        return importlib.import_module("benchmarks.demo")
    except ImportError:
        pass
    for root in (Path.cwd(), *Path.cwd().parents):
        if (root / "benchmarks" / "cases").is_dir() and (root / "src" / "opennpu").is_dir():
            for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
                del sys.modules[name]  # another distribution's `benchmarks`, if one was found
            sys.path.insert(0, str(root))
            try:
                return importlib.import_module("benchmarks.demo")
            except ImportError:
                return None
    return None


def run(threads: int | None = None, min_run_time: float = 0.2, ops=None) -> None:
    """The whole demo: the op table (`ops`: only those families' rows), then the sections."""
    threads = threads or torch.get_num_threads()
    warning = busy_warning()
    reuse_freed_memory()  # steady state: outputs reuse freed memory instead of page-faulting
    table = _benchmarks_demo()
    if table is None:
        print("op table skipped: it is built from benchmarks/cases, which come with the source "
              "checkout, not the installed package;\nrun `python -m opennpu demo` from the "
              "repository root for it.")
    else:
        print(table.op_table(threads, min_run_time, ops))
    print()
    print(training_demo(threads))
    print()
    print(compiled_model_demo(threads))
    print()
    print(npu_device_demo(threads))
    if warning:
        print(warning)


def training_demo(threads: int, steps: int = 30) -> str:
    """A short training run of one small MLP, stepped by torch_npu.optim.NpuFusedAdamW and by
    torch.optim.AdamW from the same start: the losses agree, the fused step is faster."""
    from . import optim

    def model():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                  torch.nn.GELU(), torch.nn.Linear(1024, 16)]
        return torch.nn.Sequential(*layers)

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 256, generator=gen), torch.randn(64, 16, generator=gen))
            for _ in range(8)]
    runs = {}
    with num_threads(threads):
        for name, make in (("torch.optim.AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                           ("torch.optim.AdamW(fused=True)",
                            lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
                           ("NpuFusedAdamW", lambda ps: optim.NpuFusedAdamW(ps, lr=1e-3))):
            net = model()
            opt = make(net.parameters())
            losses, step_time = [], 0.0
            for i in range(steps):
                x, y = data[i % len(data)]
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x), y)
                loss.backward()
                opt.clip_grad_norm_fused_(1.0) if hasattr(opt, "clip_grad_norm_fused_") else \
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                start = time.perf_counter()
                opt.step()
                step_time += time.perf_counter() - start
                losses.append(loss.item())
            runs[name] = (losses, step_time / steps)
    base_losses, base_time = runs["torch.optim.AdamW"]
    n_params = sum(p.numel() for p in model().parameters())
    lines = [f"training demo: MLP of {n_params / 1e6:.1f} M parameters, {steps} steps of AdamW "
             f"(lr 1e-3, clipping at 1.0), {threads} thread(s)"]
    rows = [(name, f"{losses[0]:.5f}", f"{losses[-1]:.5f}",
             f"{max(abs(a - b) for a, b in zip(losses, base_losses)):.2e}",
             f"{step_time * 1e3:.3f}", f"{base_time / step_time:.1f}x")
            for name, (losses, step_time) in runs.items()]
    header = ("optimizer", "first loss", "last loss", "max |dloss|", "step ms", "speedup")
    return "\n".join([*lines, format_table(header, rows)])


class LlamaStyleBlock(torch.nn.Module):
    """A small Llama-style decoder block written in plain PyTorch, as a user would: HF-style
    RMSNorm (fp32 up-cast), rotate_half rotary embedding on q and k, causal attention written
    out (scores * scale, masked_fill(-inf), softmax, @ v), and a SwiGLU MLP whose gate and up
    projections are one linear (split with chunk, as Phi-3 and vLLM do: the swiglu rule; two
    separate linears, as Llama's, go to the silu_mul rule instead)."""

    def __init__(self, hidden=512, heads=8, inter=1408, eps=1e-6):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, hidden // heads, eps
        self.norm1 = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.norm2 = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def rms_norm(self, x, weight):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.rms_norm(x, self.norm1)).view(b, s, 3, self.heads,
                                                              self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                      # [B, N, S, D]
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        attn = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        h = x + self.o(attn)
        gate, up = self.gate_up(self.rms_norm(h, self.norm2)).chunk(2, dim=-1)
        return h + self.down(torch.nn.functional.silu(gate) * up)


def compiled_model_demo(threads: int, seq: int = 512) -> str:
    """LlamaStyleBlock's forward, fp32, eager vs torch.compile (Inductor) vs torch.compile with
    opennpu's backend (the fusion rules, then Inductor): fusions per rule, time, error."""
    from . import compile as npu_compile

    torch.manual_seed(0)
    block = LlamaStyleBlock().eval()
    x = torch.randn(1, seq, 512)
    angles = torch.arange(seq)[:, None] * (1e4 ** (-torch.arange(0, 64, 2) / 64))[None, :]
    cos, sin = (f(torch.cat((angles, angles), -1))[None, None] for f in (torch.cos, torch.sin))
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]       # True = masked out
    args = (x, cos, sin, mask)
    backend = npu_compile.get_npu_backend()
    rows = []
    with torch.no_grad(), num_threads(threads):
        expected = block(*args)
        torch._dynamo.reset()
        default = torch.compile(block)
        ours = torch.compile(block, backend=backend)
        for name, fn in (("eager", block), ("torch.compile (Inductor)", default),
                         ("opennpu backend + Inductor", ours)):
            err = (fn(*args) - expected).abs().max().item()        # the first call compiles
            rows.append((name, time_fn(lambda: fn(*args), threads, 0.5)["median"], err))
    fusions = ", ".join(f"{rule} x{n}" for rule, n in sorted(backend.fusions.items())) or "none"
    lines = [f"compiled model demo: a Llama-style block (hidden 512, 8 heads, MLP 1408, "
             f"seq {seq}, fp32 forward), {threads} thread(s)",
             f"opennpu fusions: {fusions}"]
    base = rows[0][1]
    cells = [(name, f"{t * 1e3:.3f}", f"{base / t:.2f}x", f"{err:.2e}") for name, t, err in rows]
    return "\n".join([*lines, format_table(("", "ms", "x eager", "max |out - eager|"), cells)])


def _seed001_training(device: str, use_amp: bool, steps: int) -> tuple[list[float], float]:
    """Seed 001's manual-migration training loop (an MLP, SGD with momentum, MSE, autocast and
    GradScaler) on `device`; returns the losses and the median step time."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(device, enabled=use_amp)
    inputs = [torch.randn(128, 256) for _ in range(4)]
    batches = [(x.to(device), torch.tanh(x[:, :64]).to(device)) for x in inputs]  # learnable
    losses, times = [], []
    for step in range(steps):
        inp, target = batches[step % 4]
        start = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.float16, enabled=use_amp):
            loss = torch.nn.functional.mse_loss(net(inp).float(), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    return losses, sorted(times[2:])[len(times[2:]) // 2]


def npu_device_demo(threads: int, steps: int = 20) -> str:
    """Seed 001's training loop on the npu device and on CPU: the same losses, bit for bit in
    fp32, and the step times side by side (npu tensors run the CPU kernels on the same memory)."""
    from . import _device

    if not _device.is_registered():  # beside a visible CUDA GPU (docs/npu_device.md)
        return (f"npu device demo: skipped, the npu device is off in this process (a CUDA GPU is "
                f"visible); {_device.ENV}=1 turns it on")
    lines = [f"npu device demo: seed 001's training loop (MLP 256-256-256-64, batch 128, SGD, "
             f"{steps} steps) on {torch.npu.get_device_name(0)}, {threads} thread(s)"]
    rows = []
    with num_threads(threads):
        for use_amp in (False, True):
            cpu_losses, cpu_time = _seed001_training("cpu", use_amp, steps)
            npu_losses, npu_time = _seed001_training("npu", use_amp, steps)
            label = "fp16 autocast + scaler" if use_amp else "fp32"
            for device, losses, t in (("cpu", cpu_losses, cpu_time), ("npu", npu_losses, npu_time)):
                same = "bit-identical" if losses == cpu_losses else (
                    f"{max(abs(a - b) for a, b in zip(losses, cpu_losses)):.1e}")
                rows.append((f"{label} {device}", f"{losses[0]:.5f}", f"{losses[-1]:.5f}",
                             f"{t * 1e3:.3f}", same if device == "npu" else ""))
    header = ("", "first loss", "last loss", "step ms", "losses vs cpu")
    return "\n".join([*lines, format_table(header, rows)])

