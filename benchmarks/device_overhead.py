"""The npu device's costs against CPU, measured side by side in one process.

    python -m benchmarks.device_overhead [--repeats 15]

1. Dispatch overhead of a tiny op: a 16-element `a + b` on npu vs CPU (timeit loops, CPU and npu
   interleaved, the best repeat of each kept), and how many copies the npu loop made (none).
2. Large fresh outputs: npu_rms_norm at [8192, 4096] fp32, where each call's output is a new
   128 MiB tensor. On CPU it is a fresh host allocation whose pages fault on first touch; on npu it
   is a block the caching allocator keeps.
3. A transformers training step (forward, backward, AdamW) of a small Llama and a small GPT-2
   (hidden 256, 4 layers, batch 4 x 128 tokens) on npu vs the same model on CPU: steps
   interleaved, median of each; the losses must be bit-identical. Then the peak tensor memory of
   one step on each device (default settings: glibc malloc on CPU, opennpu's caching allocator
   on npu, whose reserved peak is shown too).
4. Where the npu backward runs: the MLP step of benchmarks.hccl_ddp (4 x Linear 512 + GELU,
   batch 64, AdamW) without DDP, forward, backward and optimizer timed apart, npu against CPU, with
   the backward in the caller's thread (the default) and on autograd's npu thread
   (multithreaded backward turned back on for the step), steps interleaved, medians.
Run it on a quiet machine: OpenMP threads that wait for busy cores make timings meaningless.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import timeit

import torch

import opennpu  # noqa: F401  (registers the npu device, also done by torch's autoload)


def best_us(fn, number: int, repeats: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def tiny_add(repeats: int) -> dict[str, float]:
    a, b = torch.randn(16), torch.randn(16)
    an, bn = a.npu(), b.npu()
    copies = torch.ops.opennpu._npu_copy_stats()[0]
    cpu, npu = [], []
    for _ in range(repeats):  # interleaved, so both sides see the same machine load
        cpu.append(best_us(lambda: a + b, 20000, 1))
        npu.append(best_us(lambda: an + bn, 20000, 1))
    return {"cpu_us": min(cpu), "npu_us": min(npu), "ratio": min(npu) / min(cpu),
            "copies": torch.ops.opennpu._npu_copy_stats()[0] - copies}


def large_outputs(repeats: int) -> dict[str, float]:
    x, g = torch.randn(8192, 4096), torch.randn(4096)
    xn, gn = x.npu(), g.npu()

    def ms(fn) -> float:
        fn()  # warm: the npu cache then holds a block of the output's size
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return min(times)

    cpu = ms(lambda: torch.ops.npu.npu_rms_norm(x, g))
    npu = ms(lambda: torch.ops.npu.npu_rms_norm(xn, gn))
    return {"cpu_ms": cpu, "npu_ms": npu, "speedup": cpu / npu}


def _transformer(kind: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(
            hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256))
    # Dropout off: the CPU and npu generators stand at different points after the weights' init,
    # so dropout masks would differ and the losses could not be compared.
    return GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=8, vocab_size=4096,
                                      n_positions=256, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _trainer(model: torch.nn.Module, device: str):
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 4096, (4, 128), generator=torch.Generator().manual_seed(1)).to(device)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def training_step(kind: str, steps: int) -> dict[str, float]:
    model = _transformer(kind)
    cpu_step, npu_step = _trainer(copy.deepcopy(model), "cpu"), _trainer(model, "npu")
    cpu_ms, npu_ms, identical = [], [], True
    for i in range(steps + 2):
        for fn, times in ((cpu_step, cpu_ms), (npu_step, npu_ms)):
            start = time.perf_counter()
            loss = fn()
            times.append((time.perf_counter() - start) * 1e3)
            if fn is cpu_step:
                cpu_loss = loss
        identical &= loss == cpu_loss
    cpu, npu = statistics.median(cpu_ms[2:]), statistics.median(npu_ms[2:])  # 2 warm-up steps
    return {"cpu_ms": cpu, "npu_ms": npu, "ratio": cpu / npu, "identical_losses": identical}


def _profiled_peak(step, memory_of) -> float:
    """Peak live tensor bytes during `step` above those alive before it. Each op event carries the
    bytes its own allocations and frees left (children apart); frees outside ops come as
    "[memory]" events. In time order their running sum is the live memory, at op granularity."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += memory_of(event)
        peak = max(peak, live)
    return peak


def peak_step_memory(kind: str) -> dict[str, float]:
    """Peak tensor memory of one training step (after warm-up), in MiB, measured alike on both
    devices by the profiler (the npu allocator reports to it as CUDA's does; its figures are the
    blocks it hands out, rounded up to 512 B / 128 KiB / 2 MiB by size class). Also how much the
    caching allocator's reserved memory grew over the step."""
    model = _transformer(kind)
    cpu_step, npu_step = _trainer(copy.deepcopy(model), "cpu"), _trainer(model, "npu")
    for _ in range(2):
        cpu_step(), npu_step()
    cpu = _profiled_peak(cpu_step, lambda e: e.self_cpu_memory_usage)
    reserved = torch.npu.memory_reserved()
    npu = _profiled_peak(npu_step, lambda e: e.self_device_memory_usage)
    mib = 2.0 ** 20
    return {"cpu": cpu / mib, "npu": npu / mib,
            "npu_reserved": (torch.npu.memory_reserved() - reserved) / mib}


def backward_thread(steps: int) -> dict[str, dict[str, float]]:
    """Per phase (fwd, bwd, opt): median ms on CPU, on npu with the backward in the caller's
    thread, and on npu with it on the autograd engine's npu thread."""

    def make(device):
        torch.manual_seed(0)
        layers = [m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]
        model = torch.nn.Sequential(*layers).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randn(64, 512).to(device), \
            torch.randn(64, 512).to(device)

    runs = {"cpu": (make("cpu"), False), "npu caller": (make("npu"), False), "npu engine": (make("npu"), True)}
    times = {name: {"fwd": [], "bwd": [], "opt": []} for name in runs}
    for i in range(steps + 5):
        for name, ((model, opt, x, y), engine_thread) in runs.items():
            with torch.autograd.set_multithreading_enabled(engine_thread):  # False: as by default on npu
                t0 = time.perf_counter()
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                t3 = time.perf_counter()
            if i >= 5:
                for phase, dt in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2)):
                    times[name][phase].append(dt * 1e3)
    return {name: {p: statistics.median(v) for p, v in phases.items()} for name, phases in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per device")
    args = parser.parse_args()
    add = tiny_add(args.repeats)
    print(f"16-element a + b: cpu {add['cpu_us']:.2f} us, npu {add['npu_us']:.2f} us, "
          f"npu/cpu {add['ratio']:.2f}x, copies made on npu: {add['copies']}")
    big = large_outputs(max(3, args.repeats // 3))
    print(f"npu_rms_norm [8192, 4096] fp32 (fresh 128 MiB output): cpu {big['cpu_ms']:.1f} ms, "
          f"npu {big['npu_ms']:.1f} ms, npu {big['speedup']:.2f}x faster")
    for kind in ("llama", "gpt2"):
        r = training_step(kind, args.steps)
        m = peak_step_memory(kind)
        print(f"{kind} training step: cpu {r['cpu_ms']:.0f} ms, npu {r['npu_ms']:.0f} ms, "
              f"npu speed {r['ratio']:.3f}x cpu's, losses bit-identical: {r['identical_losses']}; "
              f"step's peak tensor memory cpu {m['cpu']:.1f} MiB, npu {m['npu']:.1f} MiB "
              f"({(m['npu'] / m['cpu'] - 1) * 100:+.1f}%), npu cache grew {m['npu_reserved']:.1f} MiB")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    b = backward_thread(max(100, args.steps * 20))
    torch.set_num_threads(threads)
    cpu = b["cpu"]
    for name in ("npu caller", "npu engine"):
        print(f"MLP step, 1 thread, {name.replace('npu ', 'npu backward in ')}'s thread: npu/cpu time "
              + ", ".join(f"{p} {b[name][p]:.2f}/{cpu[p]:.2f} ms = {b[name][p] / cpu[p]:.3f}" for p in ("fwd", "bwd", "opt")))


if __name__ == "__main__":
    main()
