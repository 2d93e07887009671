"""The npu runtime from Python: streams and events, generators, memory statistics and OOM."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch


def test_device_queries():
    assert torch.npu.is_available()
    torch.npu.init()
    assert torch.npu.is_initialized()
    assert torch.npu.device_count() == 8
    name = torch.npu.get_device_name(0)
    assert name.startswith("Ascend910B") and "emulated" in name
    props = torch.npu.get_device_properties("npu:1")
    assert props.total_memory == 64 * 2**30 and props.name == name
    assert torch.npu.get_device_capability() is None
    free, total = torch.npu.mem_get_info()
    assert total == 64 * 2**30 and 0 < free <= total
    torch.npu.synchronize()
    torch.npu.synchronize("npu:3")


def test_streams():
    s = torch.npu.Stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("npu:0")
    assert s != torch.npu.default_stream()
    assert torch.npu.current_stream() == torch.npu.default_stream()
    with torch.npu.stream(s):
        assert torch.npu.current_stream() == s
        x = torch.ones(3, device="npu") * 2
    assert torch.npu.current_stream() == torch.npu.default_stream()
    s.wait_stream(torch.npu.current_stream())
    assert s.query()
    s.synchronize()
    torch.npu.set_stream(s)
    assert torch.npu.current_stream() == s
    torch.npu.set_stream(torch.npu.default_stream())
    s1 = torch.npu.Stream("npu:1")
    assert s1.device_index == 1 and torch.npu.current_stream(1) == torch.npu.default_stream(1)
    ext = torch.npu.ExternalStream(12345)
    assert ext.stream_id == 12345
    x.record_stream(s)


def test_events_time_the_host_work_between_them():
    start = torch.npu.Event(enable_timing=True)
    end = torch.npu.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert start.query() and end.query()
    assert 15.0 <= start.elapsed_time(end) < 2000.0
    untimed = torch.npu.Event()
    untimed.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        start.elapsed_time(untimed)
    with pytest.raises(RuntimeError):
        torch.npu.Event(enable_timing=True).elapsed_time(end)
    event = torch.npu.current_stream().record_event()
    torch.npu.Stream().wait_event(event)


def test_generators_match_cpu_draws():
    torch.manual_seed(123)  # also seeds every npu device
    expected = torch.randn(5), torch.rand(3), torch.randint(0, 10, (4,))
    torch.manual_seed(123)
    actual = (torch.randn(5, device="npu"), torch.rand(3, device="npu"),
              torch.randint(0, 10, (4,), device="npu"))
    for a, e in zip(actual, expected):
        assert a.device.type == "npu"
        torch.testing.assert_close(a.cpu(), e, rtol=0, atol=0)


def test_generator_objects_and_states():
    g = torch.Generator("npu:1")
    assert g.device == torch.device("npu:1")
    g.manual_seed(7)
    a = torch.randn(4, generator=g, device="npu:1")
    g.manual_seed(7)
    b = torch.randn(4, generator=g, device="npu:1")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert g.initial_seed() == 7

    torch.npu.manual_seed(5)
    assert torch.npu.initial_seed() == 5
    state = torch.npu.get_rng_state()
    assert state.device.type == "cpu" and state.dtype == torch.uint8
    first = torch.rand(3, device="npu")
    torch.npu.set_rng_state(state)
    torch.testing.assert_close(torch.rand(3, device="npu"), first, rtol=0, atol=0)
    states = torch.npu.get_rng_state_all()
    assert len(states) == torch.npu.device_count()
    torch.npu.set_rng_state_all(states)
    assert len(torch.npu.default_generators) == 8
    assert torch.npu.default_generators[0].device == torch.device("npu:0")
    torch.npu.manual_seed_all(3)
    assert all(gen.initial_seed() == 3 for gen in torch.npu.default_generators)
    torch.npu.seed()
    with pytest.raises(RuntimeError, match="Expected a 'npu' device type for generator"):
        torch.randn(2, device="npu", generator=torch.Generator())


def test_dropout_on_npu_matches_cpu():
    x = torch.randn(64)
    torch.manual_seed(9)
    expected = torch.nn.functional.dropout(x, 0.5)
    torch.manual_seed(9)
    actual = torch.nn.functional.dropout(x.npu(), 0.5)
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)


def _attention_with_dropout(q):
    import torch_npu

    out, _, _, _, seed, offset, numels = torch_npu.npu_fusion_attention(
        q, q, q, 2, "BSH", keep_prob=0.5)
    return out, seed, offset, numels


def test_fused_dropout_draws_from_the_device_generator():
    """npu_fusion_attention on npu takes its Philox (seed, offset) from the device's generator,
    as torch_npu's does: torch.npu.manual_seed(s) makes it reproducible and the first call draws
    (s, 0); the offset advances; get/set_rng_state replay it; other devices and opennpu's own
    stream (CPU tensors) are untouched."""
    import opennpu

    q = torch.randn(1, 8, 16).npu()
    torch.npu.manual_seed(11)
    first, seed, offset, numels = _attention_with_dropout(q)
    assert (seed, offset) == (11, 0)
    state = torch.npu.get_rng_state()
    second, seed2, offset2, _ = _attention_with_dropout(q)
    assert seed2 == 11 and offset2 == (numels + 3) // 4
    assert not torch.equal(first, second)
    torch.npu.set_rng_state(state)
    torch.testing.assert_close(_attention_with_dropout(q)[0], second, rtol=0, atol=0)
    torch.npu.manual_seed(11)
    torch.testing.assert_close(_attention_with_dropout(q)[0], first, rtol=0, atol=0)
    # Reseeding with another value changes the mask; npu:1 has its own stream.
    torch.npu.manual_seed(12)
    assert not torch.equal(_attention_with_dropout(q)[0], first)
    with torch.npu.device(1):
        torch.npu.manual_seed(11)
    assert _attention_with_dropout(q.to("npu:1"))[1:3] == (11, 0)
    # CPU tensors keep drawing from opennpu's own stream.
    opennpu.manual_seed(11)
    before = opennpu.get_rng_state()
    torch.npu.manual_seed(99)
    _attention_with_dropout(q)
    assert opennpu.get_rng_state() == before
    _, cpu_seed, cpu_offset, _ = _attention_with_dropout(q.cpu())
    assert (cpu_seed, cpu_offset) == (11, 0)


def test_memory_statistics():
    torch.npu.empty_cache()
    torch.npu.reset_peak_memory_stats()
    base = torch.npu.memory_allocated()
    x = torch.empty(1024 * 1024, device="npu")  # 4 MiB
    assert torch.npu.memory_allocated() == base + 4 * 2**20
    y = x + 1  # a fresh output of a CPU kernel counts too
    assert torch.npu.memory_allocated() == base + 8 * 2**20
    assert torch.npu.max_memory_allocated() >= base + 8 * 2**20
    del x, y
    assert torch.npu.memory_allocated() == base
    assert torch.npu.memory_reserved() >= 8 * 2**20  # cached
    stats = torch.npu.memory_stats()
    assert stats["allocated_bytes.all.current"] == base
    assert stats["reserved_bytes.all.peak"] >= 8 * 2**20
    torch.npu.empty_cache()
    assert torch.npu.memory_reserved() == torch.npu.memory_allocated()
    torch.npu.reset_peak_memory_stats()
    assert torch.npu.max_memory_allocated() == torch.npu.memory_allocated()
    summary = torch.npu.memory_summary()
    assert "PyTorch NPU memory summary, device ID 0 " in summary.splitlines()[1]
    assert "PyTorch NPU memory summary, device ID 1 " in torch.npu.memory_summary(1)
    ptr = torch.npu.caching_allocator_alloc(1000)
    assert torch.npu.memory_allocated() == base + 1024
    torch.npu.caching_allocator_delete(ptr)
    assert torch.npu.memory_allocated(1) == torch.npu.memory_stats(1)["allocated_bytes.all.current"]


def test_cache_reuses_blocks():
    torch.npu.empty_cache()
    x = torch.empty(1000, device="npu")
    ptr = x.data_ptr()
    del x
    y = torch.empty(1000, device="npu")
    assert y.data_ptr() == ptr


def test_pinned_memory():
    x = torch.randn(4).pin_memory()
    assert x.is_pinned() and x.device.type == "cpu"
    assert x[1:].is_pinned()  # any address inside a pinned block
    assert not torch.randn(4).is_pinned()
    torch.testing.assert_close(x.to("npu", non_blocking=True).cpu(), x)


def test_pinned_blocks_are_cached_and_reused():
    torch.npu.host_empty_cache()
    x = torch.empty(3000, dtype=torch.uint8).pin_memory()
    ptr, held = x.data_ptr(), torch.npu.host_memory_stats()["allocations.current"]
    del x
    y = torch.empty(2500, dtype=torch.uint8).pin_memory()  # same power-of-two bin: the same block
    assert y.data_ptr() == ptr and y.is_pinned()
    assert torch.npu.host_memory_stats()["allocations.current"] == held
    del y
    torch.npu.host_empty_cache()
    stats = torch.npu.host_memory_stats()
    assert stats["allocations.current"] == held - 1 and stats["num_host_free"] >= 1


def test_event_recorded_time():
    first, second = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    first.record()
    second.record()
    t1, t2 = first.recorded_time(), second.recorded_time()
    assert isinstance(t1, int) and 0 < t1 < t2
    with pytest.raises(RuntimeError, match="not been recorded"):
        torch.npu.Event().recorded_time()
    with pytest.raises(RuntimeError, match="not a live npu event"):  # ids are checked, not trusted
        torch.ops.opennpu._npu_event_recorded_ns(first.event_id + 8)


def test_an_allocation_beyond_one_exbibyte_fails_cleanly():
    x = torch.zeros(4, device="npu")
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate more than 1EB memory"):
        torch.empty(2**63 - 1, dtype=torch.int8, device="npu")
    x.fill_(1)
    assert x.cpu().tolist() == [1, 1, 1, 1]


OOM_SCRIPT = """
import torch
x = torch.empty(3 * 2**20, dtype=torch.uint8, device="npu")
try:
    torch.empty(2 * 2**20, dtype=torch.uint8, device="npu")
except torch.OutOfMemoryError as error:
    print("OOM", str(error).splitlines()[0])
y = x[:2**20].clone()  # fits
torch.npu.set_per_process_memory_fraction(0.5)
try:
    x + 1  # a CPU kernel's output beyond the capacity raises too
except torch.OutOfMemoryError:
    print("OOM2")
print(torch.npu.memory_stats()["num_ooms"], torch.npu.mem_get_info()[1])
"""


def test_out_of_memory_beyond_the_configured_capacity():
    result = subprocess.run([sys.executable, "-c", OOM_SCRIPT], capture_output=True, text=True,
                            env={**os.environ, "OPENNPU_DEVICE_MEMORY": "4M"}, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("OOM NPU out of memory. Tried to allocate 2.00 MiB (NPU 0; 4.00 MiB total capacity; 3.00 MiB already allocated")
    assert lines[1] == "OOM2"
    assert lines[2] == f"2 {4 * 2**20}"


def test_visible_devices_and_device_count_from_the_environment():
    code = "import torch; print(torch.npu.device_count(), torch.ops.opennpu._npu_visible_devices())"
    # parsing stops at the first entry that is not an ascending id below the device count
    cases = {"1,3,x,5": "2 [1, 3]", "": "0 []", "2,1,9": "1 [2]"}
    for visible, expected in cases.items():
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={**os.environ, "ASCEND_RT_VISIBLE_DEVICES": visible}, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected, visible
    result = subprocess.run([sys.executable, "-c", "import torch; print(torch.npu.device_count(), torch.npu.get_device_name())"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OPENNPU_DEVICE_COUNT": "2", "OPENNPU_SOC_NAME": "Ascend910_9392"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("2 Ascend910_9392 (emulated")


LAZY_INIT_SCRIPT = """
import os, torch, torch_npu
before = torch.npu.is_initialized()
os.environ["ASCEND_RT_VISIBLE_DEVICES"] = "0,1"
count = torch.npu.device_count()
torch.empty(1, device="npu")  # initialises the runtime: the visible devices are fixed
os.environ["ASCEND_RT_VISIBLE_DEVICES"] = "0"
print(before, count, torch.npu.is_initialized(), torch.npu.device_count(),
      torch_npu._C._npu_getDeviceCount())
"""


def test_visible_devices_are_read_until_the_runtime_initialises():
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_RT_VISIBLE_DEVICES"}
    result = subprocess.run([sys.executable, "-c", LAZY_INIT_SCRIPT], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "2", "True", "2", "2"]


def test_profiler_sees_npu_allocations():
    """torch.profiler(profile_memory=True) reports npu tensor memory as device memory, per op."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(256, 256, device="npu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = x * 2
        del y
    events = list(prof.events())
    mul = [e for e in events if e.name == "aten::mul"]
    assert mul and mul[0].device_memory_usage >= 256 * 256 * 4
    assert sum(e.self_device_memory_usage for e in events) == 0  # the free is reported too
