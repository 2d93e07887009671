"""opennpu's `torch_npu.testing`: TestCase's comparisons, create_common_tensor, SupportedDevices,
the Dtypes/Formats parametrization and run_tests, checked on small cases that must pass and
must fail."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import unittest

import numpy as np
import pytest
import torch

import torch_npu  # noqa: F401
from torch_npu.testing.common_utils import (SkipIfNotGteCANNVersion, SupportedDevices,
                                            create_common_tensor, create_dtype_tensor)
from torch_npu.testing.decorator import Dtypes, Formats, instantiate_tests
from torch_npu.testing.testcase import TestCase


class _Probe(TestCase):
    def runTest(self):  # a TestCase instance to call the assertions on
        pass


@pytest.fixture
def tc():
    return _Probe()


def test_rtol_equal_accepts_within_tolerance_across_devices(tc):
    x = torch.randn(100)
    tc.assertRtolEqual(x, x.npu() * (1 + 5e-5))
    tc.assertRtolEqual(x.numpy(), (x * (1 + 5e-5)).numpy())
    tc.assertRtolEqual(x.half(), (x * (1 + 5e-4)).half().npu())
    tc.assertRtolEqual(x.bfloat16().npu(), x.bfloat16())
    tc.assertRtolEqual([x, x.int()], [x.npu(), x.int().npu()])
    tc.assertRtolEqual(torch.tensor([float("nan"), float("inf")]),
                       torch.tensor([float("nan"), float("inf")]).npu())


def test_rtol_equal_rejects(tc):
    x = torch.randn(100)
    with pytest.raises(AssertionError, match="result error"):
        tc.assertRtolEqual(x, x.npu() * 1.01)
    with pytest.raises(AssertionError, match="result error"):
        tc.assertRtolEqual(x.half(), (x * 1.01).half())
    with pytest.raises(AssertionError, match="bfloat16 results differ"):
        tc.assertRtolEqual(x.bfloat16(), (x * 1.05).bfloat16())
    with pytest.raises(AssertionError, match="dtype error"):
        tc.assertRtolEqual(x, x.double())
    with pytest.raises(AssertionError, match="shape error"):
        tc.assertRtolEqual(x, x[:50])
    with pytest.raises(AssertionError, match="NaNs at different places"):
        tc.assertRtolEqual(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0]))
    with pytest.raises(AssertionError, match="boolean results differ"):
        tc.assertRtolEqual(x > 0, x < 0)


def test_rtol_equal_tolerates_a_fraction_of_outliers(tc):
    # Ascend's rule: the comparison fails only when more than prec * numel elements are off.
    x = torch.ones(100_000)
    y = x.clone()
    y[:5] = 2.0  # 5 outliers <= 1e-4 * 100000 = 10
    tc.assertRtolEqual(x, y)
    y[:20] = 2.0
    with pytest.raises(AssertionError):
        tc.assertRtolEqual(x, y)


def test_rtol_equal_auto_trans_dtype(tc):
    x = torch.randn(10)
    tc.assertRtolEqual(x.double(), x, auto_trans_dtype=True)
    with pytest.raises(AssertionError, match="dtype error"):
        tc.assertRtolEqual(x.double(), x)


def test_assert_equal_tensors_arrays_numbers_containers(tc):
    x = torch.randn(3, 4)
    tc.assertEqual(x, x.npu())
    tc.assertEqual(x.npu(), x.numpy())
    tc.assertEqual(x.numpy(), x.npu())
    tc.assertEqual(x.npu(1), x + 1e-6)
    tc.assertEqual(torch.tensor(2.5).npu(), 2.5)
    tc.assertEqual({"a": x, "b": [1, 2]}, {"a": x.npu(), "b": [1, 2]})
    tc.assertEqual(x.size(), [3, 4])
    tc.assertEqual(x.half().npu(), x.half(), prec=1e-3)
    tc.assertEqual(torch.tensor([float("nan")]).npu(), torch.tensor([float("nan")]))
    tc.assertEqual("npu", "npu")


def test_assert_equal_rejects(tc):
    x = torch.randn(3, 4)
    with pytest.raises(AssertionError):
        tc.assertEqual(x, x.npu() + 1e-3)
    with pytest.raises(AssertionError):
        tc.assertEqual(x, x.t().contiguous().npu())
    with pytest.raises(AssertionError):
        tc.assertEqual(x.npu(), x.double(), exact_dtype=True)
    with pytest.raises(AssertionError):
        tc.assertEqual([1, 2], [1, 2, 3])
    with pytest.raises(AssertionError):
        tc.assertEqual(1.0, float("inf"))
    with pytest.raises(AssertionError):
        tc.assertEqual({"a": 1}, {"b": 1})
    tc.assertNotEqual(x, x.npu() + 1)
    with pytest.raises(AssertionError):
        tc.assertNotEqual(x, x.npu())


def test_create_common_tensor():
    cpu, npu = create_common_tensor([np.float16, 2, (4, 5)], -3, 3)
    assert cpu.dtype == npu.dtype == torch.float16
    assert cpu.device.type == "cpu" and npu.device == torch.device("npu:0")
    assert torch.equal(cpu, npu.cpu())
    assert float(cpu.min()) >= -3 and float(cpu.max()) <= 3
    _, on1 = create_common_tensor([np.float32, -1, [3]], 0, 1, device="npu:1")
    assert on1.device == torch.device("npu:1")
    with pytest.raises(ValueError, match="item must be"):
        create_common_tensor([np.float32, (3,)], 0, 1)
    cpu, npu = create_dtype_tensor((5,), torch.int32, min_value=0, max_value=3, no_zero=True)
    assert cpu.dtype == torch.int32 and int(cpu.min()) >= 1 and torch.equal(cpu, npu.cpu())


def _run(case: type[unittest.TestCase]) -> unittest.TestResult:
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    return result


def test_supported_devices_gates_on_the_soc_name(monkeypatch):
    ran = []

    class Gated(TestCase):
        @SupportedDevices(["Ascend910B"])
        def test_910b(self):
            ran.append("910B")

        @SupportedDevices(["Ascend310P", "Ascend910_93"])
        def test_other(self):
            ran.append("other")

    monkeypatch.setenv("OPENNPU_SOC_NAME", "Ascend910B")
    result = _run(Gated)
    assert ran == ["910B"] and len(result.skipped) == 1
    assert "current device is Ascend910B" in result.skipped[0][1]

    ran.clear()
    monkeypatch.setenv("OPENNPU_SOC_NAME", "Ascend910_9392")
    _run(Gated)
    assert ran == ["other"]  # the 910_xx family compares 12 characters
    with pytest.raises(TypeError, match="list of SoC names"):
        SupportedDevices("Ascend910B")


def test_cann_version_gate_skips_with_reason():
    class Gated(TestCase):
        @SkipIfNotGteCANNVersion("8.1.RC1")
        def test_new_cann(self):
            raise AssertionError("must not run")

    result = _run(Gated)
    assert len(result.skipped) == 1 and "8.1.RC1" in result.skipped[0][1]


def test_dtypes_and_formats_expand_into_named_tests():
    seen = []

    @instantiate_tests
    class Expanded(TestCase):
        @Dtypes(torch.float16, torch.float32)
        @Formats(2, 29)
        def test_op(self, device, dtype, npu_format):
            seen.append((device, dtype, npu_format))

    names = sorted(n for n in dir(Expanded) if n.startswith("test_op"))
    assert names == ["test_op_float16_2", "test_op_float16_29", "test_op_float32_2",
                     "test_op_float32_29"]
    assert not _run(Expanded).failures
    assert sorted(seen, key=str) == sorted([("npu", d, f) for d in (torch.float16, torch.float32)
                                            for f in (2, 29)], key=str)
    with pytest.raises(RuntimeError, match="Dtypes: expected torch dtypes"):
        Dtypes("float16")


def test_seeded_setup_and_run_tests_in_a_script(tmp_path):
    script = tmp_path / "test_upstream_style.py"
    script.write_text(textwrap.dedent("""
        import torch
        import torch_npu
        from torch_npu.testing.testcase import TestCase, run_tests

        class TestAdd(TestCase):
            def test_add(self):
                x = torch.randn(4)
                self.assertRtolEqual(x + x, (x.npu() + x.npu()).cpu())
                self.assertEqual(torch.npu.current_device(), 0)
                self.assertEqual(self.npu_device, "npu:0")

            def test_fails(self):
                self.assertRtolEqual(torch.ones(3), torch.zeros(3))

        if __name__ == "__main__":
            run_tests()
    """))
    result = subprocess.run([sys.executable, str(script), "-v"], capture_output=True, text=True,
                            timeout=120)
    assert "test_add (__main__.TestAdd" in result.stderr and "ok" in result.stderr
    assert "FAILED (failures=1)" in result.stderr and result.returncode == 1


def test_setup_seeds_torch_and_numpy_from_seed_env(tc, monkeypatch):
    monkeypatch.setenv("SEED", "1234")
    tc.setUp()
    drawn = (torch.randn(3), np.random.rand(3))
    torch.manual_seed(1234)
    np.random.seed(1234)
    assert torch.equal(drawn[0], torch.randn(3)) and np.array_equal(drawn[1], np.random.rand(3))


def test_multi_npu_gate_counts_visible_devices():
    from torch_npu.testing.common_distributed import TEST_SKIPS, skipIfUnsupportMultiNPU

    ran = []

    class Gated(TestCase):
        @skipIfUnsupportMultiNPU(2)
        def test_two(self):
            ran.append(2)

        @skipIfUnsupportMultiNPU(torch.npu.device_count() + 1)
        def test_too_many(self):
            ran.append("too many")

    result = _run(Gated)
    assert ran == [2] and len(result.skipped) == 1
    assert TEST_SKIPS["multi-npu-8"].message == "Need at least 8 ASCEND devices"


def test_assert_equal_with_none_and_mixed_types(tc):
    tc.assertNotEqual(12345, None)
    with pytest.raises(AssertionError):
        tc.assertEqual(1, None)
    tc.assertEqual(None, None)


def test_import_makes_device_type_tests_run_on_npu():
    import os

    import torch_npu.testing  # noqa: F401
    from torch.testing._internal import common_device_type

    assert common_device_type.onlyCUDA is common_device_type.onlyPRIVATEUSE1
    assert os.environ["PYTORCH_TESTING_DEVICE_FOR_CUSTOM"] == "privateuse1"
