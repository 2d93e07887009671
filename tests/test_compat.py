"""`import torch_npu` maps onto opennpu when Ascend's torch_npu is absent, and steps aside when
it is present."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import opennpu
from opennpu.compat import npu_op_names


def test_torch_npu_exposes_every_op_under_its_name():
    import torch_npu

    assert torch_npu.IS_OPENNPU
    for name in npu_op_names():
        assert callable(getattr(torch_npu, name)), name


def test_torch_npu_accepts_input_keyword_for_self():
    import torch_npu

    x = torch.rand(5, 4)
    torch.testing.assert_close(torch_npu.fast_gelu(input=x), opennpu.fast_gelu(x))
    torch.testing.assert_close(torch_npu.npu_fast_gelu(self=x), opennpu.fast_gelu(x))
    y, rstd = torch_npu.npu_rms_norm(input=x, gamma=torch.ones(4), epsilon=1e-5)
    torch.testing.assert_close(y, opennpu.npu_rms_norm(x, torch.ones(4), 1e-5)[0])


def test_torch_npu_keyword_names_follow_the_schema():
    import torch_npu

    x, r = torch.rand(1, 4, 2, 8), torch.rand(1, 4, 1, 8)
    out = torch_npu.npu_rotary_mul(x, r1=r, r2=r, rotary_mode="interleave")
    torch.testing.assert_close(out, opennpu.npu_rotary_mul(x, r, r, "interleave"))


def test_torch_npu_exposes_each_overload_as_an_attribute():
    """torch_npu.<op>.<overload> as torch_npu's graph handlers and tests use them; an out overload
    also takes torch_npu's out= list."""
    import torch_npu

    for name in npu_op_names():
        packet = getattr(torch.ops.npu, name)
        for overload in packet.overloads():
            assert callable(getattr(getattr(torch_npu, name), overload)), (name, overload)
    fia = torch_npu.npu_fused_infer_attention_score
    assert fia.out is fia.out  # a fixed object: torch_npu's handlers compare `func is func_out`
    q, k, v = torch.rand(1, 2, 1, 8), torch.rand(1, 2, 5, 8), torch.rand(1, 2, 5, 8)
    kw = dict(num_heads=2, input_layout="BNSD", scale=0.3, softmax_lse_flag=True)
    want = fia(q, k, v, **kw)
    ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(q, k, v, **kw)
    o, lse = torch.empty(1, 2, 1, 8), torch.empty(1, 2, 1, 1)
    fia.out(q, k, v, workspace=ws, out=[o, lse], **kw)
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
    o2 = torch.empty(1, 2, 1, 8)
    fia.out(q, k, v, attention_out=o2, softmax_lse=lse, **kw)  # the schema's own names
    assert torch.equal(o2, want[0])
    assert torch.equal(fia.default(q, k, v, **kw)[0], want[0])
    with pytest.raises(TypeError, match="out= must hold 2 tensor"):
        fia.out(q, k, v, out=[o], **kw)
    x = torch.rand(5, 4)
    torch.testing.assert_close(torch_npu.fast_gelu.default(input=x), opennpu.fast_gelu(x))


def test_real_torch_npu_wins_and_opennpu_says_so(tmp_path):
    fake_real = tmp_path / "torch_npu"
    fake_real.mkdir()
    (fake_real / "__init__.py").write_text("REAL = True\n")
    script = textwrap.dedent(
        """
        import warnings
        import torch_npu
        assert getattr(torch_npu, "REAL", False), torch_npu
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import opennpu
        assert any("Ascend's torch_npu is installed" in str(w.message) for w in caught), caught
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
