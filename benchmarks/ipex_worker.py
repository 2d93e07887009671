"""The IPEX side of benchmarks/ipex_peer.py: a long-lived worker run by another Python.

    /path/to/venv-ipex/bin/python benchmarks/ipex_worker.py TIMING_PY

Intel Extension for PyTorch 2.8 needs torch 2.8, so it runs in its own virtualenv, in this
process, which never imports opennpu. It talks JSON lines with the harness: one request on stdin,
one reply on the protocol stream (the process's original stdout; anything a library prints goes
to stderr):

    {"cmd": "setup", "case": "rms_norm", "shape": {...}, "dtype": "bf16", "seed": 0,
     "threads": 2, "out": "/tmp/x.pt"}
        builds the case's inputs (make_inputs, the same function the harness builds its own with),
        runs IPEX's op once and saves its outputs to `out` (torch.save) for the error check;
        replies {"ok": true, "checksum": ...} (of the inputs, which the harness compares with its
        own), {"skip": reason} where this IPEX lacks the op, or {"error": text}
    {"cmd": "time", "min_run_time": 0.5}
        times the case set up last with TIMING_PY's time_fn (opennpu/testing/timing.py, the file
        the harness times its own side with): replies {"median", "p20", "p80"} in seconds
    {"cmd": "quit"}

Only torch and benchmarks/common.py are imported at module level: the harness imports
make_inputs from here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import torch

try:  # imported by the harness as benchmarks.ipex_worker, or run as a script from benchmarks/
    from .common import DTYPES, gpt2_small_shapes
except ImportError:
    from common import DTYPES, gpt2_small_shapes

EPS = 1e-6
# AdamW without weight decay, which is Adam: IPEX's CPU build fuses only Adam's step (its fused
# AdamW is XPU-only, and its Adam's decay is L2, not AdamW's decoupled one).
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def _randn(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def make_inputs(case: str, shape: dict, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """The inputs of a case, identical in both processes (torch's CPU generator, fp32 draws)."""
    torch.manual_seed(seed)
    if case in ("rms_norm", "add_rms_norm", "add_rms_norm_inplace"):
        t, h = shape["T"], shape["H"]
        x = [_randn(t, h, dtype=dtype) for _ in range(1 if case == "rms_norm" else 2)]
        return [*x, (1 + 0.1 * torch.randn(h)).to(dtype)]
    if case == "rotary_mul":  # x [1, S, N, D] (BSND), cos / sin [1, S, 1, D] ('half' mode)
        s, n, d = shape["S"], shape["N"], shape["D"]
        angle = torch.rand(s, d // 2) * 6.283
        angle = torch.cat((angle, angle), dim=-1).view(1, s, 1, d)
        return [_randn(1, s, n, d, dtype=dtype), angle.cos().to(dtype), angle.sin().to(dtype)]
    if case == "attention":  # q [1, S, N, D], k / v [1, S, Nkv, D] (BSND)
        s, n, nkv, d = shape["S"], shape["N"], shape["Nkv"], shape["D"]
        return [_randn(1, s, n, d, dtype=dtype), _randn(1, s, nkv, d, dtype=dtype),
                _randn(1, s, nkv, d, dtype=dtype)]
    if case == "llama_layer":  # hidden states [1, S, H], then the layer's weights (LLAMA_WEIGHTS)
        x = _randn(1, shape["S"], shape["H"], dtype=dtype)
        weights = []
        for name, dims in llama_weight_shapes(shape):
            if len(dims) == 1:  # the norms' gammas
                weights.append((0.5 + torch.rand(dims)).to(dtype))
            else:  # nn.Linear [out, in], scaled so that activations stay O(1)
                weights.append((torch.randn(dims) / math.sqrt(dims[1])).to(dtype))
        return [x, *weights]
    if case == "adamw":  # parameters then gradients, GPT-2 small's shapes
        shapes = gpt2_small_shapes()
        params = [_randn(*s, dtype=dtype) for s in shapes]
        return params + [(torch.randn(s) * 1e-2).to(dtype) for s in shapes]
    raise ValueError(f"unknown case {case!r}")


def llama_weight_shapes(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama decoder layer's parameters, named as in transformers' LlamaDecoderLayer."""
    h, i = shape["H"], shape["I"]
    kv = h * shape["Nkv"] // shape["N"]
    return [("input_layernorm.weight", (h,)), ("self_attn.q_proj.weight", (h, h)),
            ("self_attn.k_proj.weight", (kv, h)), ("self_attn.v_proj.weight", (kv, h)),
            ("self_attn.o_proj.weight", (h, h)), ("post_attention_layernorm.weight", (h,)),
            ("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)),
            ("mlp.down_proj.weight", (h, i))]


def llama_config(shape: dict):
    """transformers' LlamaConfig of the case: one layer, no bias, a small vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape["H"], num_attention_heads=shape["N"],
                       num_key_value_heads=shape["Nkv"], intermediate_size=shape["I"],
                       num_hidden_layers=1, vocab_size=128, max_position_embeddings=8192,
                       rms_norm_eps=EPS, attention_dropout=0.0,
                       architectures=["LlamaForCausalLM"])


def checksum(inputs: list[torch.Tensor]) -> float:
    return math.fsum(t.double().sum().item() for t in inputs)


def ipex_case(case: str, shape: dict, inputs: list[torch.Tensor]):
    """IPEX's call for a case: (fn, outputs) where fn() is timed and outputs() gives the tensors
    to check, from fresh inputs (fn may update its inputs in place, as add_back and AdamW do)."""
    import intel_extension_for_pytorch as ipex

    ops = torch.ops.torch_ipex
    if case == "rms_norm":  # ipex.llm.functional.rms_norm's kernel
        x, w = inputs
        fn = lambda: ops.rmsnorm(x, w, EPS)  # noqa: E731
        return fn, fn
    if case in ("add_rms_norm", "add_rms_norm_inplace"):
        # ipex.llm.functional.add_rms_norm(residual, x, ..., add_back=True)'s kernel: the sum is
        # written into the residual in place (torch_npu's op returns it as a new tensor). Each
        # call adds x2 again: the values drift, the times do not.
        x1, x2, w = inputs
        residual = x1.clone()

        def outputs():
            r = x1.clone()
            return ops.add_rmsnorm(x2, r, w, EPS, True), r
        return lambda: ops.add_rmsnorm(x2, residual, w, EPS, True), outputs
    if case == "rotary_mul":
        # the kernel under ipex.llm.functional.rotary_embedding, on one tensor ('half' layout,
        # offset D / 2), out of place; its table is [S, D] fp32 = (sin, cos) halves, built once
        x, cos, sin = inputs
        s, n, d = x.shape[1], x.shape[2], x.shape[3]
        sin_cos = torch.cat((sin.view(s, d)[:, : d // 2], cos.view(s, d)[:, : d // 2]), 1)
        sin_cos, pos = sin_cos.float().contiguous(), torch.tensor(0)
        fn = lambda: ops.rotary_position_embedding(x, sin_cos, pos, n, d, d // 2, d)[0]  # noqa: E731
        return fn, fn
    if case == "attention":
        # torch_ipex::flash_attention (BNSD views of the BSND inputs; its output is BSND in
        # memory). It has no GQA (fewer kv heads give NaN): k / v are repeated to the query's
        # heads first, outside the timed call, as IPEX's model code does.
        q, k, v = inputs
        group = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        scale = 1.0 / math.sqrt(q.shape[-1])

        def fn():
            out = ops.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      0.0, True, scale=scale)[0]
            return out.transpose(1, 2)
        return fn, fn
    if case == "llama_layer":
        # ipex.llm.optimize on a one-layer LlamaForCausalLM (IPEX's validated transformers), then
        # its decoder layer called as its LlamaModel calls it in a prefill: a 4-D causal mask
        # from IPEX's own op, position ids, a fresh KV cache (IPEX's layer fills it).
        from transformers import LlamaForCausalLM

        x, weights = inputs[0], inputs[1:]
        dtype = x.dtype
        model = LlamaForCausalLM(llama_config(shape)).eval().to(dtype)
        names = [name for name, _ in llama_weight_shapes(shape)]
        model.model.layers[0].load_state_dict(dict(zip(names, weights)), strict=True)
        try:
            model = ipex.llm.optimize(model, dtype=dtype, inplace=True, deployment_mode=False)
        except AssertionError as error:  # e.g. bf16 weight prepacking on a CPU without AVX-512
            raise NotImplementedError(f"ipex.llm.optimize: {error}") from error
        layer = model.model.layers[0]
        s = x.shape[1]
        mask = ops.prepare_4d_causal_attention_mask(
            torch.ones(1, s, dtype=torch.long), x, torch.tensor(0).contiguous(),
            torch.tensor(torch.finfo(dtype).min).contiguous(), 8192)
        position_ids = torch.arange(s)[None]

        def fn():
            with torch.no_grad():
                return layer(x, attention_mask=mask, position_ids=position_ids,
                             past_key_value=None, use_cache=True)[0]
        return fn, fn
    if case == "adamw":  # ipex.optimize's Adam: its step runs torch_ipex::adam_fused_step
        n = len(inputs) // 2
        model = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in inputs[:n]])
        for p, g in zip(model, inputs[n:]):
            p.grad = g.clone()
        opt = torch.optim.Adam(model.parameters(), **ADAMW)
        model, opt = ipex.optimize(model, dtype=inputs[0].dtype, optimizer=opt, level="O1",
                                   inplace=True)
        if not getattr(opt, "fused", False):
            raise NotImplementedError("ipex.optimize left Adam's step unfused")
        first = []

        def outputs():  # the first step from the fresh parameters; later steps are timed
            if not first:
                opt.step()
                first.extend(p.detach().clone() for p in model.parameters())
            return first
        return opt.step, outputs
    raise ValueError(f"unknown case {case!r}")


def _load_timing(path: str):
    spec = importlib.util.spec_from_file_location("opennpu_timing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(requests, replies, timing, build=ipex_case) -> None:
    """The request loop (build: ipex_case; a test passes its own)."""
    fn = None
    threads = 1
    for line in requests:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "quit":
                return
            if msg["cmd"] == "setup":
                fn = None
                threads = msg["threads"]
                torch.set_num_threads(threads)
                inputs = make_inputs(msg["case"], msg["shape"], DTYPES[msg["dtype"]], msg["seed"])
                try:
                    fn, outputs = build(msg["case"], msg["shape"], inputs)
                    torch.save(outputs(), msg["out"])
                    fn()  # warm-up
                except (AttributeError, NotImplementedError, RuntimeError) as error:
                    fn = None
                    reply = {"skip": f"{type(error).__name__}: {error}"}
                else:
                    reply = {"ok": True, "checksum": checksum(inputs)}
            elif msg["cmd"] == "time":
                if fn is None:
                    raise RuntimeError("no case is set up")
                reply = timing.time_fn(fn, threads, msg["min_run_time"])
            else:
                raise ValueError(f"unknown command {msg['cmd']!r}")
        except Exception as error:  # reported to the harness, which goes on with the next case
            reply = {"error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _import_ipex() -> str:
    import intel_extension_for_pytorch as ipex

    return ipex.__version__


def main(build=ipex_case, import_library=_import_ipex) -> int:
    """Greets the harness with the versions (or the import's error), then serves. A test passes
    a fake build and import_library."""
    replies = os.fdopen(os.dup(1), "w")  # the protocol stream; prints go to stderr from here on
    os.dup2(2, 1)
    timing = _load_timing(sys.argv[1])
    timing.reuse_freed_memory()  # the harness's malloc setting
    try:
        version = import_library()
    except Exception as error:
        replies.write(json.dumps({"error": f"import intel_extension_for_pytorch: "
                                           f"{type(error).__name__}: {error}"}) + "\n")
        return 1
    replies.write(json.dumps({"ok": True, "torch": torch.__version__, "ipex": version}) + "\n")
    replies.flush()
    serve(sys.stdin, replies, timing, build)
    return 0


if __name__ == "__main__":
    sys.exit(main())
