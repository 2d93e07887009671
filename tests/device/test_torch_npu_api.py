"""torch.npu / torch_npu functions whose behaviour follows torch_npu's own tests (Ascend/pytorch
test/npu): argument checks and their messages, and the values torch_npu answers with."""

from __future__ import annotations

import copy
import uuid
import warnings

import pytest
import torch

import torch_npu


def test_wrong_device_type_names_a_npu_device():
    with pytest.raises(ValueError, match="Expected a npu device, but got: cpu"):
        torch.npu.synchronize("cpu")
    with pytest.raises(ValueError, match="Expected a npu device, but got: cpu"):
        torch.npu._get_device_index(torch.device("cpu"), optional=True)


def test_sync_debug_mode_rejects_unknown_modes():
    for bad in (-1, 3):
        with pytest.raises(RuntimeError, match="expected one of 0,1,2"):
            torch.npu.set_sync_debug_mode(bad)
    with pytest.raises(RuntimeError, match="`default`, `warn`, `error`"):
        torch.npu.set_sync_debug_mode("loud")
    try:
        torch.npu.set_sync_debug_mode("warn")
        assert torch.npu.get_sync_debug_mode() == 1
        with pytest.raises(RuntimeError):
            torch.npu.set_sync_debug_mode(7)
        assert torch.npu.get_sync_debug_mode() == 1  # a rejected mode changes nothing
    finally:
        torch.npu.set_sync_debug_mode(0)


def test_can_device_access_peer():
    assert torch.npu.can_device_access_peer(0, 1) is True
    assert torch.npu.can_device_access_peer(1, 1) is False
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.npu.can_device_access_peer(-1, 0)
    with pytest.raises(AssertionError, match="Invalid peer device id"):
        torch.npu.can_device_access_peer(0, torch.npu.device_count())


def test_device_capability_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("TORCH_NPU_DEVICE_CAPABILITY", raising=False)
    with pytest.warns(UserWarning, match="TORCH_NPU_DEVICE_CAPABILITY"):
        assert torch.npu.get_device_capability() is None
    monkeypatch.setenv("TORCH_NPU_DEVICE_CAPABILITY", "8.6")
    assert torch.npu.get_device_capability(0) == (8, 6)
    assert torch.npu.get_device_capability("whatever the argument") == (8, 6)
    monkeypatch.setenv("TORCH_NPU_DEVICE_CAPABILITY", "8.x")
    with pytest.warns(UserWarning, match="can't parse"):
        assert torch.npu.get_device_capability() is None


def test_device_properties_uuid_and_cuda_only_fields():
    p0, p1 = torch.npu.get_device_properties(0), torch.npu.get_device_properties(1)
    assert isinstance(p0.uuid, uuid.UUID) and len(str(p0.uuid)) == 36
    assert p0.uuid == torch.npu.get_device_properties(0).uuid and p0.uuid != p1.uuid
    for field in ("major", "minor", "warp_size", "gcnArchName", "is_integrated"):
        assert getattr(p0, field) is None


def test_memory_fraction_argument_checks():
    with pytest.raises(TypeError, match="Invalid type"):
        torch.npu.set_per_process_memory_fraction(1)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="Invalid fraction value"):
            torch.npu.set_per_process_memory_fraction(bad)
    assert torch.npu.get_per_process_memory_fraction() == 1.0


def test_memory_summary_has_torch_cuda_layout_and_counts():
    torch.npu.empty_cache()
    torch.npu.reset_peak_memory_stats()
    x = torch.empty(2048, dtype=torch.uint8, device="npu")
    lines = torch.npu.memory_summary().splitlines()
    assert lines[0] == "|" + "=" * 75 + "|" and all(len(line) == 77 for line in lines)
    assert "NPU OOMs:" in lines[3] and "npuMalloc retries:" in lines[3]
    stats = torch.npu.memory_stats()
    row = next(line for line in lines if line.startswith("| Allocations"))

    def shown(n):  # counts of 10000 and more are shown in thousands ("21 K")
        return (str(n), "") if n < 10000 else (str(n // 1000), "K")

    cells = [tuple((c.split() + [""])[:2]) for c in row.split("|")[2:6]]
    assert cells == [shown(stats[f"allocation.all.{k}"])
                     for k in ("current", "peak", "allocated", "freed")]
    assert int(cells[0][0]) >= 1
    del x


def test_small_answers_torch_npu_gives():
    assert torch.npu.get_allocator_backend() == "native"
    with pytest.warns(UserWarning, match="blas handle"):
        assert torch.npu.current_blas_handle() is None
    with pytest.warns(UserWarning, match="aclnn.version"):
        assert torch.npu.aclnn.version() is None


def test_aclnn_allow_hf32_is_the_conv_switch():
    assert torch.npu.aclnn.allow_hf32 is True
    try:
        torch.npu.aclnn.allow_hf32 = False
        assert torch.npu.conv.allow_hf32 is False
        with pytest.raises(TypeError, match="torch.npu.aclnn.allow_hf32 must be a bool"):
            torch.npu.aclnn.allow_hf32 = 1
    finally:
        torch.npu.aclnn.allow_hf32 = True


def test_use_compatible_impl_reads_back():
    old = torch.npu.are_compatible_impl_enabled()
    try:
        torch.npu.use_compatible_impl(True)
        assert torch.npu.are_compatible_impl_enabled() is True
        torch.npu.use_compatible_impl(False)
        assert torch.npu.are_compatible_impl_enabled() is False
    finally:
        torch.npu.use_compatible_impl(old)


def test_empty_with_format_and_storage_size():
    x = torch_npu.empty_with_format((2, 3), dtype=torch.float16, device="npu", acl_format=29)
    assert x.shape == (2, 3) and x.dtype == torch.float16 and x.device.type == "npu"
    assert torch_npu.get_npu_format(x) == 29  # recorded; the bytes are stored in ND
    with pytest.raises(ValueError, match="empty_with_format: acl_format 5"):
        torch_npu.empty_with_format((2,), device="npu", acl_format=5)
    with pytest.raises(NotImplementedError, match="base_addr_aligned_kb"):
        torch_npu.empty_with_format((2,), device="npu", base_addr_aligned_kb=2)
    base = torch.randn(4, 5).npu()
    assert torch_npu.get_storage_size(base) == 20
    assert torch_npu.get_storage_size(base[1:3]) == 20  # the storage, not the view
    assert torch_npu.get_storage_size(copy.deepcopy(base)) == 20
    with pytest.raises(RuntimeError, match="get_storage_size: expected an npu tensor"):
        torch_npu.get_storage_size(torch.ones(2))


def test_erase_stream_checks_its_arguments():
    s = torch.npu.Stream()
    t = torch.ones(4, device="npu")
    t.record_stream(s)
    torch_npu.erase_stream(t, s)
    with pytest.raises(TypeError, match="erase_stream: tensor should be torch.Tensor"):
        torch_npu.erase_stream([1], s)
    with pytest.raises(TypeError, match="erase_stream: stream should be"):
        torch_npu.erase_stream(t, "npu")


def test_legacy_storage_types():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        s = torch.randn(3).storage()
        assert isinstance(s.npu().half(), torch.npu.HalfStorage)
        assert not isinstance(s.npu().float(), torch.npu.HalfStorage)
        assert not isinstance(s.float(), torch.npu.FloatStorage)  # a CPU storage
        made = torch.npu.LongStorage([1, 2, 3])
        assert made.device == torch.device("npu:0") and made.dtype == torch.int64
        assert made.tolist() == [1, 2, 3]
        assert len(torch.npu.FloatStorage(5)) == 5
        assert torch.npu.FloatStorage(2, device="npu:1").device == torch.device("npu:1")
