"""Every op in torch.ops.npu is complete: CPU kernel, fake kernel, a gradient decision, a public
wrapper, a torch_npu alias and a test module that exercises it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import opennpu
from opennpu.compat import npu_op_names
from opennpu.ops._registry import DIFFERENTIABILITY

OPS = npu_op_names()


def qualname(name: str) -> str:
    """The dispatcher name of an op's (only) overload: npu::<name> for the default overload,
    npu::<name>.<overload> otherwise (torch_npu's _npu_dropout_gen_mask exists only as .Tensor)."""
    overload = getattr(torch.ops.npu, name).overloads()[0]
    return f"npu::{name}" if overload == "default" else f"npu::{name}.{overload}"


TEST_SOURCES = "\n".join(p.read_text() for p in (Path(__file__).parent / "ops").glob("test_*.py"))


def test_the_expected_ops_are_registered():
    expected = {
        "npu_rms_norm", "npu_rms_norm_backward", "npu_gemma_rms_norm", "npu_add_rms_norm",
        "npu_swiglu", "npu_swiglu_backward", "npu_geglu", "npu_geglu_grad",
        "fast_gelu", "npu_fast_gelu", "npu_fast_gelu_backward",
        "npu_rotary_mul", "npu_rotary_mul_backward",
        "npu_fusion_attention", "npu_fusion_attention_grad", "_npu_dropout_gen_mask",
        "npu_confusion_transpose", "npu_confusion_transpose_backward",
        "npu_scaled_masked_softmax", "npu_scaled_masked_softmax_backward",
        "npu_add_rms_norm_cast", "npu_dynamic_quant", "npu_add_rms_norm_dynamic_quant",
        "npu_moe_gating_top_k_softmax", "npu_moe_init_routing", "npu_moe_compute_expert_tokens",
        "npu_moe_finalize_routing", "npu_grouped_matmul",
        "npu_ffn",
    }
    assert expected <= set(OPS)


@pytest.mark.parametrize("name", OPS)
def test_op_has_cpu_and_fake_kernels(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname(name), "CPU"), (
        f"{name}: no CPU kernel")
    entry = torch._library.simple_registry.singleton.find(qualname(name))
    assert entry.fake_impl.kernel is not None, f"{name}: no fake kernel"


@pytest.mark.parametrize("name", OPS)
def test_op_has_a_gradient_decision(name):
    assert name in DIFFERENTIABILITY, f"{name}: neither an autograd formula nor a documented reason"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname(name), "Autograd")


@pytest.mark.parametrize("name", OPS)
def test_op_is_public_and_tested(name):
    assert callable(getattr(opennpu, name)), f"{name}: no opennpu.{name}"
    assert getattr(opennpu, name).__doc__, f"opennpu.{name} has no docstring"
    assert f"{name}(" in TEST_SOURCES or f".{name}," in TEST_SOURCES, f"{name}: no test calls it"


def test_every_overload_has_cpu_fake_and_autograd_kernels():
    # qualname() above checks an op's first overload; npu_grouped_matmul also has .List
    for name in OPS:
        packet = getattr(torch.ops.npu, name)
        for overload in packet.overloads():
            qual = f"npu::{name}" if overload == "default" else f"npu::{name}.{overload}"
            for key in ("CPU", "Autograd"):
                assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, key), (qual, key)
            entry = torch._library.simple_registry.singleton.find(qual)
            assert entry.fake_impl.kernel is not None, f"{qual}: no fake kernel"


def test_double_backward_of_a_backward_op_raises_clearly():
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    dx = opennpu.npu_swiglu_backward(g, x)
    with pytest.raises(RuntimeError, match="npu_swiglu_backward: double backward"):
        dx.sum().backward()


def test_cpu_isa_is_reported():
    assert opennpu.cpu_isa() in {"AVX512", "AVX2", "DEFAULT"}


def test_every_native_cuda_kernel_is_compared_with_the_cpu_kernel():
    # A C++ kernel registered for the CUDA key (csrc/ops/<family>/*_cuda.cu) replaces the portable
    # path there; a tests/ops/test_*cuda*.py file must call it (they run wherever a GPU is visible).
    from pathlib import Path

    from opennpu.ops import portable

    native = sorted(q.split("::")[1].split(".")[0] for q, devices in portable.PORTABLE_DEVICES.items()
                    if "cuda" not in devices)
    source = "".join(f.read_text() for f in (Path(__file__).parent / "ops").glob("test_*cuda*.py"))
    assert [name for name in native if name not in source] == []


# torch.ops.atb (torch_npu's ATB ops, src/opennpu/ops/atb.py) meets the same bar.
ATB_OPS = sorted(n for n in dir(torch.ops.atb)
                 if isinstance(getattr(torch.ops.atb, n), torch._ops.OpOverloadPacket))


def test_the_atb_ops_are_registered():
    from opennpu.ops.atb import ATB_OPS as declared

    assert set(ATB_OPS) == set(declared)


@pytest.mark.parametrize("name", ATB_OPS)
def test_atb_op_is_complete(name):
    from opennpu.ops import atb

    packet = getattr(torch.ops.atb, name)
    for overload in packet.overloads():
        qual = f"atb::{name}" if overload == "default" else f"atb::{name}.{overload}"
        for key in ("CPU", "Autograd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, key), (qual, key)
        assert torch._library.simple_registry.singleton.find(qual).fake_impl.kernel is not None
    assert f"atb::{name}" in DIFFERENTIABILITY
    assert callable(getattr(atb, name)) and getattr(atb, name).__doc__
    assert f"{name}(" in TEST_SOURCES, f"{name}: no test calls it"
