"""Intel Extension for PyTorch (IPEX) as an optional peer: ours against IPEX's op, interleaved.

    python -m benchmarks.ipex_peer --ipex-python /work/venv-ipex/bin/python [--ops ...]
    python -m benchmarks.run ... --ipex-python PATH      (or OPENNPU_IPEX_PYTHON=PATH)

IPEX 2.8 needs torch 2.8, so it runs in a virtualenv of its own: a worker process started with
that Python (benchmarks/ipex_worker.py), talking over a pipe. Per case both processes build the
same inputs (ipex_worker.make_inputs, same seed; the worker returns a checksum of its inputs,
compared here), then the two are timed in alternating blocks, ours here then IPEX there, over
`repeats` rounds, with the same timer (opennpu.testing.timing.time_fn, whose file the worker
loads), thread count and malloc setting, so that the machine's drift hits both alike. Reported:
each side's median over the rounds' medians, ratio = IPEX time / ours (> 1: we are faster), and
both sides' max abs error against a float64 reference, also as a multiple of the rounding floor
(the error of the float64 result rounded to the case's dtype).

The llama_layer case also needs transformers in that virtualenv (IPEX 2.8 is validated with 4.51.3:
`pip install transformers==4.51.3`); ours runs the layer of this environment's transformers with
the same weights. IPEX refuses bf16 on CPUs without AVX-512 (its weight prepacking): that row is
then skipped with IPEX's message.

IPEX's CPU kernels are written for AVX-512 (and AMX); on an AVX2-only CPU it runs its AVX2
builds or falls back to ATen, so a ratio measured there says nothing about IPEX on Intel CPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import opennpu
import torch
from opennpu import optim
from opennpu.testing import timing

from .ipex_worker import (ADAMW, DTYPES, EPS, checksum, llama_config, llama_weight_shapes,
                          make_inputs)

ENV = "OPENNPU_IPEX_PYTHON"
WORKER = Path(__file__).with_name("ipex_worker.py")
npu = torch.ops.npu


@dataclass
class IpexCase:
    op: str  # the family name benchmarks.run's --ops selects
    shape: dict
    dtypes: tuple[str, ...]
    ipex_op: str = ""  # the worker's case, where it differs from op (ours compiled otherwise)

    @property
    def peer(self) -> str:
        return self.ipex_op or self.op

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.shape.items())


CASES = (
    IpexCase("rms_norm", {"T": 8192, "H": 4096}, ("fp32", "bf16")),
    IpexCase("add_rms_norm", {"T": 8192, "H": 4096}, ("fp32", "bf16")),
    # graph mode's in-place variant (rule add_rms_norm_inplace): the sum into x2's buffer, as
    # IPEX's add_back writes it into the residual
    IpexCase("add_rms_norm_inplace", {"T": 8192, "H": 4096}, ("fp32", "bf16")),
    IpexCase("rotary_mul", {"S": 8192, "N": 32, "D": 128}, ("fp32", "bf16")),
    IpexCase("attention", {"S": 2048, "N": 32, "Nkv": 32, "D": 128}, ("fp32", "bf16")),
    IpexCase("attention", {"S": 2048, "N": 32, "Nkv": 8, "D": 128}, ("fp32", "bf16")),
    IpexCase("llama_layer", {"S": 512, "H": 1024, "N": 16, "Nkv": 4, "I": 2816}, ("fp32", "bf16")),
    IpexCase("llama_layer", {"S": 2048, "H": 1024, "N": 16, "Nkv": 4, "I": 2816}, ("fp32", "bf16")),
    # the same layer with the opt-in rule linear_onednn (float32 linears through oneDNN)
    IpexCase("llama_layer_onednn", {"S": 512, "H": 1024, "N": 16, "Nkv": 4, "I": 2816}, ("fp32",),
             ipex_op="llama_layer"),
    IpexCase("llama_layer_onednn", {"S": 2048, "H": 1024, "N": 16, "Nkv": 4, "I": 2816}, ("fp32",),
             ipex_op="llama_layer"),
    IpexCase("adamw", {"params": "GPT-2 small 124M", "wd": 0}, ("fp32",)),
)


# ------------------------------------------------------------------ ours and the float64 oracle

def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _attention64(q, k, v):
    """Causal attention in float64, BSND, one query head at a time (bounded memory)."""
    s, n, nkv = q.shape[1], q.shape[2], k.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(n):
        qh, kh, vh = q[0, :, h].double(), k[0, :, h * nkv // n].double(), v[0, :, h * nkv // n].double()
        scores = (qh @ kh.T / math.sqrt(q.shape[-1])).masked_fill(mask, -math.inf)
        out[0, :, h] = scores.softmax(-1) @ vh
    return out


def _adamw64(params, grads):
    """One AdamW step (step 1, fresh states) in float64."""
    lr, (b1, b2), eps, wd = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
    out = []
    for p, g in zip(params, grads):
        p, g = p.double(), g.double()
        m, v = (1 - b1) * g, (1 - b2) * g * g
        out.append(p * (1 - lr * wd) - lr * (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + eps))
    return out


def _llama_layer(shape: dict, weights, dtype):
    """transformers' LlamaDecoderLayer with the case's weights, and its rotary embedding."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = llama_config(shape)
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0).eval().to(dtype)
    names = [name for name, _ in llama_weight_shapes(shape)]
    layer.load_state_dict({n: w.to(dtype) for n, w in zip(names, weights)}, strict=True)
    return layer, LlamaRotaryEmbedding(config=config)


class _LlamaCall(torch.nn.Module):
    """layer(hidden_states, position_embeddings=(cos, sin)), as LlamaModel calls it (no padding:
    attention_mask None, so SDPA runs causal)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, cos, sin):
        out = self.layer(x, attention_mask=None, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out


def _llama_case(shape: dict, inputs: list[torch.Tensor], enabled_patterns=()):
    """The layer compiled with opennpu's backend (default CompilerConfig, plus the opt-in rules
    `enabled_patterns`), against the float64 eager layer. cos / sin are computed once outside the timed call, as LlamaModel shares them
    across layers (IPEX's layer computes its own from a cached table)."""
    from opennpu.compile import CompilerConfig, get_npu_backend

    config = CompilerConfig()
    config.experimental_config.enabled_patterns = enabled_patterns
    x, weights = inputs[0], inputs[1:]
    layer, rotary = _llama_layer(shape, weights, x.dtype)
    with torch.no_grad():
        cos, sin = rotary(x, torch.arange(x.shape[1])[None])
    module = _LlamaCall(layer)
    compiled_fn = torch.compile(module, backend=get_npu_backend(compiler_config=config),
                                dynamic=False)

    def fn():  # the first call compiles, with Inductor's C++ kernels fixed to the thread count
        with torch.no_grad(), torch._inductor.config.patch({"cpp.threads": torch.get_num_threads()}):
            return compiled_fn(x, cos, sin)

    def reference():
        layer64 = _LlamaCall(_llama_layer(shape, weights, torch.float64)[0])
        return layer64(x.double(), cos.double(), sin.double())
    return fn, fn, reference


def _add_rms_norm64(x1, x2, w):
    """(y, x1 + x2) of add + RMSNorm in float64."""
    s = x1.double() + x2.double()
    return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS) * w.double(), s


def ours_case(op: str, inputs: list[torch.Tensor], shape: dict | None = None):
    """(fn, outputs, reference): fn() is timed; outputs() gives the tensors checked against
    reference() (float64), from fresh inputs."""
    if op == "llama_layer":
        return _llama_case(shape, inputs)
    if op == "llama_layer_onednn":
        return _llama_case(shape, inputs, enabled_patterns=("linear_onednn",))
    if op == "rms_norm":
        x, w = inputs
        fn = lambda: npu.npu_rms_norm(x, w, EPS)[0]  # noqa: E731

        def reference():
            x64 = x.double()
            return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS) * w.double()
        return fn, fn, reference
    if op == "add_rms_norm":
        x1, x2, w = inputs
        fn = lambda: npu.npu_add_rms_norm(x1, x2, w, EPS)[::2]  # (y, x1 + x2)  # noqa: E731
        return fn, fn, lambda: _add_rms_norm64(x1, x2, w)
    if op == "add_rms_norm_inplace":
        x1, x2, w = inputs
        residual = x2.clone()
        fn = lambda: torch.ops.opennpu._add_rms_norm_inplace(x1, residual, w, EPS)  # noqa: E731

        def outputs():
            r = x2.clone()
            return torch.ops.opennpu._add_rms_norm_inplace(x1, r, w, EPS)[0], r
        return fn, outputs, lambda: _add_rms_norm64(x1, x2, w)
    if op == "rotary_mul":
        x, cos, sin = inputs
        fn = lambda: npu.npu_rotary_mul(x, cos, sin)  # noqa: E731
        return fn, fn, lambda: x.double() * cos.double() + _rotate_half(x.double()) * sin.double()
    if op == "attention":
        q, k, v = inputs
        causal = torch.ones(2048, 2048, dtype=torch.bool).triu(1)  # compressed, not read
        fn = lambda: npu.npu_fusion_attention(  # noqa: E731
            q, k, v, q.shape[2], "BSND", atten_mask=causal, scale=1 / math.sqrt(q.shape[-1]),
            sparse_mode=2)[0]
        return fn, fn, lambda: _attention64(q, k, v)
    if op == "adamw":
        n = len(inputs) // 2
        params = [torch.nn.Parameter(p.clone()) for p in inputs[:n]]
        for p, g in zip(params, inputs[n:]):
            p.grad = g.clone()
        opt = optim.NpuFusedAdamW(params, **ADAMW)
        first = []

        def outputs():
            if not first:
                opt.step()
                first.extend(p.detach().clone() for p in params)
            return first
        return opt.step, outputs, lambda: _adamw64(inputs[:n], inputs[n:])
    raise ValueError(f"unknown op {op!r}")


def _as_list(t):
    return [t] if isinstance(t, torch.Tensor) else list(t)


def errors(outputs, reference, dtype) -> tuple[float, float]:
    """(max abs error against reference, that error over the rounding floor's)."""
    err = floor = 0.0
    for a, r in zip(_as_list(outputs), _as_list(reference), strict=True):
        err = max(err, (a.double() - r).abs().max().item())
        floor = max(floor, (r.to(dtype).double() - r).abs().max().item())
    return err, err / floor if floor > 0 else math.nan


# ------------------------------------------------------------------ the worker


class IpexWorker:
    """The worker process: one JSON request, one JSON reply (benchmarks/ipex_worker.py)."""

    def __init__(self, python: str, args: list[str] | None = None):
        cmd = [python, str(WORKER), timing.__file__] if args is None else [python, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONPATH": ""})
        hello = self._read()
        if "error" in hello:
            self.close()
            raise RuntimeError(hello["error"])
        self.versions = f"torch {hello.get('torch')}, IPEX {hello.get('ipex')}"

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the IPEX worker exited (code {self.proc.poll()})")
        return json.loads(line)

    def request(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"IPEX worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.wait(timeout=30)


def run_case(worker: IpexWorker, case: IpexCase, dtype_name: str, threads: int, repeats: int,
             min_run_time: float, seed: int = 0) -> dict:
    """One row: both sides' median times, the ratio IPEX / ours, and both errors."""
    dtype = DTYPES[dtype_name]
    row = {"op": case.op, "shape": case.label, "dtype": dtype_name, "threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "ipex_out.pt")
        reply = worker.request(cmd="setup", case=case.peer, shape=case.shape, dtype=dtype_name,
                               seed=seed, threads=threads, out=out_path)
        if "skip" in reply:
            return {**row, "skip": reply["skip"]}
        inputs = make_inputs(case.peer, case.shape, dtype, seed)
        if not math.isclose(reply["checksum"], checksum(inputs), rel_tol=1e-12, abs_tol=1e-6):
            raise RuntimeError(f"the IPEX worker built other inputs (checksum {reply['checksum']}"
                               f" != {checksum(inputs)})")
        fn, outputs, reference = ours_case(case.op, inputs, case.shape)
        with torch.no_grad(), timing.num_threads(threads):
            expected = reference()
            row["err_ours"], row["floor_ours"] = errors(outputs(), expected, dtype)
            row["err_ipex"], row["floor_ipex"] = errors(
                torch.load(out_path, weights_only=True), expected, dtype)
            del expected
            fn()  # warm-up
            ours, ipex = [], []
            for _ in range(repeats):  # alternating blocks: ours, then IPEX
                ours.append(timing.time_fn(fn, threads, min_run_time)["median"])
                ipex.append(worker.request(cmd="time", min_run_time=min_run_time)["median"])
    row["ours"], row["ipex"] = statistics.median(ours), statistics.median(ipex)
    row["ratio"] = row["ipex"] / row["ours"]
    return row


HEADER = (f"{'op':<21}{'shape':<36}{'dtype':<6}{'thr':>3}{'ours ms':>10}{'IPEX ms':>10}"
          f"{'x IPEX':>8}{'err ours':>10}{'/floor':>7}{'err IPEX':>10}{'/floor':>7}")


def format_row(row: dict) -> str:
    head = f"{row['op']:<21}{row['shape']:<36}{row['dtype']:<6}{row['threads']:>3}"
    if "skip" in row:
        return f"{head}  IPEX skipped: {row['skip']}"
    return (f"{head}{row['ours'] * 1e3:>10.4g}{row['ipex'] * 1e3:>10.4g}{row['ratio']:>7.2f}x"
            f"{row['err_ours']:>10.2e}{row['floor_ours']:>7.2f}"
            f"{row['err_ipex']:>10.2e}{row['floor_ipex']:>7.2f}")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_table(python: str | None, ops, dtypes, threads, repeats=5, min_run_time=0.3,
              print_fn=print) -> tuple[list[dict], list[str]]:
    """Every case selected by ops / dtypes (names) on each thread count: (rows, notes). Without
    an IPEX Python (none given, or it cannot import IPEX) the table is skipped with a note."""
    if not python:
        return [], [f"IPEX column skipped: no --ipex-python or {ENV} names a Python with "
                    "torch 2.8 + intel_extension_for_pytorch"]
    try:
        worker = IpexWorker(python)
    except (OSError, RuntimeError) as error:
        return [], [f"IPEX column skipped: {python}: {error}"]
    rows, notes = [], []
    try:
        print_fn(f"IPEX peer: {worker.versions} in {python}; ours: torch {torch.__version__}, "
                 f"opennpu ISA {opennpu.cpu_isa()}; CPU {cpu_name()}; {repeats} alternating "
                 f"rounds; x IPEX = IPEX time / ours (> 1: ours faster); errors against float64, "
                 f"/floor = over the float64 result's rounding to the dtype")
        print_fn(HEADER)
        for case in CASES:
            if case.op not in ops:
                continue
            for dtype_name in (d for d in case.dtypes if d in dtypes):
                for n in threads:
                    try:
                        row = run_case(worker, case, dtype_name, n, repeats, min_run_time)
                    except RuntimeError as error:
                        notes.append(f"FAILED IPEX peer {case.op} {case.label} {dtype_name}: "
                                     f"{error}")
                        print_fn(notes[-1])
                        if worker.proc.poll() is not None:
                            return rows, notes
                        continue
                    print_fn(format_row(row))
                    rows.append(row)
    finally:
        worker.close()
    return rows, notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ipex_peer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--ipex-python", default=os.environ.get(ENV),
                        help=f"the Python of a torch 2.8 + IPEX virtualenv (default: ${ENV})")
    parser.add_argument("--ops", default=",".join(dict.fromkeys(c.op for c in CASES)))
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    timing.reuse_freed_memory()
    rows, notes = run_table(args.ipex_python, args.ops.split(","), args.dtypes.split(","),
                            [int(n) for n in args.threads.split(",")], args.repeats,
                            args.min_run_time)
    for note in notes:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "rows": rows, "notes": notes}, f, indent=1)
    return 1 if any(note.startswith("FAILED") for note in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
