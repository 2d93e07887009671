"""`import torch_npu` maps onto opennpu when Ascend's torch_npu is absent, and steps aside when
it is present."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
