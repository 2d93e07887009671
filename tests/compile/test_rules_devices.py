"""The pre_autograd rules (rms_norm, add_rms_norm, swiglu, rotary, scaled_masked_softmax,
confusion_transpose) fire only on devices where the fused op (and its backward) has a kernel:
elsewhere the native code must run as it is."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fusion_helpers import count, run_compiled
from opennpu.compile import fusion
from test_rules_norm import HFRMSNorm
from test_rules_rotary import SeedRotary
from test_rules_softmax import SeedSoftmax
from test_rules_swiglu import GateUp, SeedSwiGlu
from test_rules_transpose import Fn, seed_example_one


class AddNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = HFRMSNorm(16)

    def forward(self, x, residual):
        h = x + residual
        return self.norm(h), h


def cases(device):
    mask = torch.zeros(1, 1, 8, 40, dtype=torch.bool, device=device)
    return [
        ("rms_norm", HFRMSNorm(16).to(device), (torch.randn(4, 16, device=device),)),
        ("add_rms_norm", AddNorm().to(device), (torch.randn(4, 16, device=device),
                                               torch.randn(4, 16, device=device))),
        ("swiglu", SeedSwiGlu(), (torch.randn(4, 16, device=device),)),
        ("silu_mul", GateUp(), (torch.randn(4, 16, device=device),
                                torch.randn(4, 16, device=device))),
        ("rotary", SeedRotary(), (torch.randn(2, 6, 3, 16, device=device),
                                  torch.randn(1, 6, 1, 16, device=device),
                                  torch.randn(1, 6, 1, 16, device=device))),
        ("scaled_masked_softmax", SeedSoftmax(), (torch.randn(2, 3, 8, 40, device=device), mask)),
        ("confusion_transpose", Fn(seed_example_one), (torch.randn(4, 3, 6, 5, device=device),)),
    ]


def _cuda_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op if "::" in op else f"npu::{op}",
                                                          "CUDA")


OPS = {"rms_norm": "npu_rms_norm", "add_rms_norm": "npu_add_rms_norm", "swiglu": "npu_swiglu",
       "silu_mul": "opennpu::_silu_mul", "rotary": "npu_rotary_mul",
       "scaled_masked_softmax": "npu_scaled_masked_softmax",
       "confusion_transpose": "npu_confusion_transpose"}
BACKWARD = {"npu_add_rms_norm": "npu_rms_norm_backward"}


@pytest.mark.parametrize("index", range(7), ids=[c[0] for c in cases("cpu")])
@pytest.mark.parametrize("device", ["cpu", "npu", "cuda"])
def test_rules_see_the_device_of_the_traced_graph(index, device):
    """The pre_autograd rules on a graph traced with fake tensors of `device` (no GPU needed):
    fused on CPU, where the kernels are, and on npu, which runs the CPU kernels; on CUDA only once
    the op and its backward have CUDA kernels."""
    rule, module, args = cases("cpu")[index]
    mode = FakeTensorMode()

    def fake(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    with mode:
        fakes = [fake(a) for a in args]
        params = {name: fake(p) for name, p in module.named_parameters()}
    # Parameters as graph inputs, as Dynamo passes them (and on the same fake device).
    gm = fusion.pre_autograd_trace(
        lambda params, *inputs: torch.func.functional_call(module, params, inputs),
        [params, *fakes])
    with mode:
        counts = fusion.apply_rules("pre_autograd", gm)
    op = OPS[rule]
    fused = device in ("cpu", "npu") or (device == "cuda" and _cuda_kernel(op)
                                and _cuda_kernel(BACKWARD.get(op, f"{op}_backward")))
    # add_rms_norm fuses the residual add into the norm the rms_norm rule made first.
    expected = {"rms_norm": 1, "add_rms_norm": 1} if rule == "add_rms_norm" else {rule: 1}
    assert counts == (expected if fused else {})
    assert count(fusion.node_targets(gm), f"{op.replace('::', '.')}." if "::" in op
                 else f"npu.{op}.") == int(fused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("index", range(7), ids=[c[0] for c in cases("cpu")])
def test_cuda_fuses_only_ops_with_cuda_kernels(index):
    rule, module, args = cases("cuda")[index]
    compiled = run_compiled(module, *args)
    op = OPS[rule]
    fused = _cuda_kernel(op) and _cuda_kernel(BACKWARD.get(op, f"{op}_backward"))
    expected = {"rms_norm": 1, "add_rms_norm": 1} if rule == "add_rms_norm" else {rule: 1}
    assert compiled.fusions == (expected if fused else {})
    torch.testing.assert_close(compiled.outputs, module(*args))
