"""Ascend-only switches: accepted, validated and recorded, without effect on the computation;
names opennpu does not provide raise an AttributeError that names them."""

from __future__ import annotations

import pytest
import torch

import torch_npu
from opennpu.npu import npu_config


@pytest.fixture(autouse=True)
def _fresh_options():
    saved = dict(npu_config._options)
    npu_config._options.clear()
    yield
    npu_config._options.clear()
    npu_config._options.update(saved)


def test_allow_internal_format_reads_back_and_checks_type():
    assert torch.npu.config.allow_internal_format is False
    torch.npu.config.allow_internal_format = True
    assert torch.npu.config.allow_internal_format is True
    with pytest.raises(TypeError, match=r"config\.allow_internal_format must be a bool"):
        torch.npu.config.allow_internal_format = "yes"
    with pytest.raises(AttributeError, match=r"torch\.npu\.config\.allow_nz is not provided"):
        torch.npu.config.allow_nz = True


def test_hf32_flags_have_torch_npu_defaults_and_follow_set_option():
    assert torch.npu.matmul.allow_hf32 is False
    assert torch.npu.conv.allow_hf32 is True
    torch.npu.matmul.allow_hf32 = True
    torch.npu.conv.allow_hf32 = False
    assert (torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32) == (True, False)
    torch.npu.set_option({"ALLOW_MATMUL_HF32": "disable"})
    assert torch.npu.matmul.allow_hf32 is False
    with pytest.raises(TypeError, match=r"torch\.npu\.matmul\.allow_hf32 must be a bool"):
        torch.npu.matmul.allow_hf32 = 1


def test_hf32_does_not_change_fp32_matmul():
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    torch.npu.matmul.allow_hf32 = True
    assert torch.equal((a.npu() @ b.npu()).cpu(), a @ b)


def test_set_compile_mode():
    torch.npu.set_compile_mode(jit_compile=False)
    assert torch.npu.is_jit_compile_false()
    torch.npu.set_compile_mode(jit_compile=True)
    assert not torch.npu.is_jit_compile_false()
    with pytest.raises(TypeError, match="set_compile_mode: jit_compile must be a bool"):
        torch.npu.set_compile_mode(jit_compile="false")


def test_set_option_validates_like_cann():
    torch.npu.set_option({"ACL_PRECISION_MODE": "must_keep_origin_dtype", "ACL_AICORE_NUM": 8,
                          "ACL_DEBUG_DIR": "/tmp/x", "NPU_FUZZY_COMPILE_BLACKLIST": "Add"})
    assert npu_config._get_option("ACL_AICORE_NUM") == "8"
    assert npu_config._get_option("NPU_FUZZY_COMPILE_BLACKLIST") == "Add"
    with pytest.raises(TypeError, match="set_option: option must be a dict, got list"):
        torch.npu.set_option(["ACL_PRECISION_MODE"])
    with pytest.raises(ValueError, match="value of ACL_PRECISION_MODE should be in"):
        torch.npu.set_option({"ACL_PRECISION_MODE": "fast"})
    with pytest.raises(ValueError, match="value of ACL_AICORE_NUM must be an integer in 1..32"):
        torch.npu.set_option({"ACL_AICORE_NUM": 33})
    with pytest.warns(UserWarning, match="ACL_OP_SELECT_IMPL_MODE will be deprecated"):
        torch.npu.set_option({"ACL_OP_SELECT_IMPL_MODE": "high_precision"})


def test_a_rejected_option_records_nothing():
    with pytest.raises(ValueError):
        torch.npu.set_option({"ACL_DEBUG_DIR": "/d", "ACL_OP_DEBUG_LEVEL": "9"})
    assert npu_config._get_option("ACL_DEBUG_DIR") is None


def test_mm_bmm_format_nd():
    assert torch.npu.get_mm_bmm_format_nd()
    torch.npu.set_mm_bmm_format_nd(False)
    assert not torch.npu.get_mm_bmm_format_nd()


def test_format_cast_records_the_format():
    x = torch.randn(4, 16).npu()
    before = x.cpu()
    assert torch_npu.get_npu_format(x) == 2  # never cast: its rank's base format
    assert torch_npu.npu_format_cast(x, 0) is x  # base to base: a relabel of x itself
    assert torch_npu.get_npu_format(x) == 0 and torch_npu.get_npu_format(x[1:]) == 0
    y = torch_npu.npu_format_cast(x, 29)  # to a private format: a new tensor, x keeps its own
    assert y is not x and torch.equal(y.cpu(), before) and torch_npu.get_npu_format(y) == 29
    assert torch_npu.get_npu_format(x) == 0 and torch_npu.get_npu_format(y[1:]) == 29
    assert torch_npu.npu_format_cast(y, 29) is y
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast(x, y)) == 29  # the format of y
    assert x.npu_format_cast_(29) is x and torch_npu.get_npu_format(x) == 29  # in place
    assert torch_npu.get_npu_format(x.npu_format_cast(2)) == 2
    p = torch.nn.Parameter(torch.randn(3, 8).npu())
    p.data = torch_npu.npu_format_cast(p.data, 29)  # vllm-ascend's way of casting a weight
    assert torch_npu.get_npu_format(p) == 29
    assert torch_npu.get_npu_format(torch.empty(1, 2, 3, 4, device="npu")) == 0  # NCHW
    assert torch_npu.get_npu_format(torch.empty(1, 2, 3, 4, 5, device="npu")) == 30  # NCDHW


def test_format_cast_follows_torch_npus_storage_format_rules():
    x4 = torch_npu.npu_format_cast(torch.randn(2, 2, 4, 4).npu(), 3)
    assert torch_npu.get_npu_format(x4) == 3
    x4 = torch_npu.npu_format_cast(x4, 2)
    assert torch_npu.get_npu_format(x4) == 0  # out of 5HD, a 4-D ND is NCHW
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast(x4, 2)) == 2  # relabel NCHW -> ND
    v = torch.randn(8).npu()
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast(v, 29)) == 2  # no NZ below rank 2
    # a freed storage's record does not leak into a new tensor at the same address
    for _ in range(3):
        t = torch.randn(64, 64).npu()
        assert torch_npu.get_npu_format(t) == 2
        torch_npu.npu_format_cast_(t, 29)
        del t


def test_format_cast_keeps_autograd_and_compiles():
    a = torch.randn(2, 3).npu().requires_grad_()
    b = torch_npu.npu_format_cast(a, 29)
    assert b.requires_grad
    b.sum().backward()
    assert torch.equal(a.grad.cpu(), torch.ones(2, 3))

    @torch.compile(fullgraph=True, backend="eager")
    def f(t):
        return torch_npu.npu_format_cast(t * 2, 29) + 1

    x = torch.randn(3, 4).npu()
    assert torch.equal(f(x).cpu(), (x * 2 + 1).cpu())


def test_format_cast_errors_name_the_argument():
    x = torch.randn(4).npu()
    with pytest.raises(ValueError, match="npu_format_cast: acl_format 5 is not an ACL format"):
        torch_npu.npu_format_cast(x, 5)
    with pytest.raises(TypeError, match="npu_format_cast: acl_format must be an int"):
        torch_npu.npu_format_cast(x, "ND")
    with pytest.raises(ValueError, match="npu_format_cast_: acl_format -1 is not an ACL format"):
        torch_npu.npu_format_cast_(x, -1)
    with pytest.raises(TypeError, match="npu_format_cast: customize_dtype must be a dtype"):
        torch_npu.npu_format_cast(x, 29, customize_dtype="fp16")
    with pytest.raises(RuntimeError, match="npu_format_cast: self must be an npu tensor"):
        torch_npu.npu_format_cast(torch.randn(4), 2)
    with pytest.raises(RuntimeError, match="get_npu_format: expected an npu tensor, got cpu"):
        torch_npu.get_npu_format(torch.randn(4))


def test_names_not_provided_raise_naming_them():
    with pytest.raises(AttributeError, match=r"torch\.npu\.set_aoe is not provided by opennpu"):
        torch.npu.set_aoe("/tmp/aoe")
    with pytest.raises(AttributeError,
                       match=r"torch_npu\.npu\.utils\.get_cann_version is not provided by opennpu"):
        torch_npu.npu.utils.get_cann_version()
    assert not hasattr(torch.npu, "stress_detect")  # libraries probe with hasattr
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        torch.npu.no_such_name


def test_npu_utils_module_names():
    import torch_npu.npu.utils as utils

    assert utils is torch.npu.utils
    assert utils.synchronize is torch.npu.synchronize
    assert utils.current_device() == torch.npu.current_device()
    assert utils.is_support_inf_nan()


def test_collect_env_reports_the_emulated_device():
    """torch_npu.utils.collect_env (the bug template's `python -m torch_npu.utils.collect_env`):
    a module, runnable with -m through the compatibility alias, reporting opennpu and no CANN."""
    import importlib.util

    from torch_npu.utils import collect_env

    spec = importlib.util.find_spec("torch_npu.utils.collect_env")
    assert spec.submodule_search_locations is None and spec.loader.get_code(spec.name) is not None
    assert collect_env.get_cann_version() == "not known"
    assert collect_env.get_torch_npu_version().startswith("opennpu ")
    info = collect_env.SystemEnv(**{f: None for f in collect_env.SystemEnv._fields})._replace(
        torch_version="2.11.0", pip_version="pip3", pip_packages="numpy==2.0\ntorch==2.11.0",
        conda_packages="", npu_device="Ascend910B (emulated), 8 devices", cann_version="not known")
    text = collect_env.pretty_str(info)
    assert "PyTorch version: 2.11.0" in text and "NPU: Ascend910B (emulated), 8 devices" in text
    assert "[pip3] numpy==2.0\n[pip3] torch==2.11.0" in text and "[conda] No relevant packages" in text
    assert "GCC version: Could not collect" in text and "CANN: not known" in text
