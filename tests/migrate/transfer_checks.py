"""Checks of transfer_to_npu, run in a subprocess by test_transfer_to_npu.py (the patches change
torch for the whole process): `python transfer_checks.py` applies transfer_to_npu, runs every
`check_*` function and prints one JSON object {name: "ok" or the traceback}.

Lines marked `# LOG: <text>` must appear in the migration log with that line number and a message
containing <text> (test_migration_log reads the markers).
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import traceback
from unittest import mock
import warnings

import torch


def _npu(t, index=None):
    assert t.device.type == "npu", t.device
    if index is not None:
        assert t.device.index == index, t.device


# -- torch.cuda API ---------------------------------------------------------------------------

def check_cuda_device_api():
    assert torch.cuda.is_available() is True
    assert torch.cuda.device_count() == torch.npu.device_count() > 1
    torch.cuda.init()  # the npu runtime initialises lazily, as CUDA's
    assert torch.cuda.is_initialized() and torch.cuda.is_bf16_supported()
    torch.cuda.set_device("cuda:1")  # LOG: change device 'cuda:1' of torch.cuda.set_device to 'npu:1'
    assert torch.cuda.current_device() == 1 == torch.npu.current_device()
    torch.cuda.set_device(torch.device("cuda", 0))
    assert torch.cuda.current_device() == 0
    torch.cuda.set_device(1)
    assert torch.npu.current_device() == 1
    torch.cuda.set_device(0)
    with torch.cuda.device(1):
        assert torch.npu.current_device() == 1
    with torch.cuda.device("cuda:1"):
        assert torch.npu.current_device() == 1
    assert torch.npu.current_device() == 0
    torch.cuda.synchronize()
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize(torch.device("cuda:1"))
    assert torch.cuda.get_device_name(0) == torch.npu.get_device_name(0)
    assert torch.cuda.get_device_name("cuda:0") == torch.npu.get_device_name(0)
    props = torch.cuda.get_device_properties(torch.device("cuda:0"))
    assert props.total_memory == torch.npu.get_device_properties(0).total_memory > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.cuda.get_device_capability("cuda:0") == torch.npu.get_device_capability(0)
    assert torch.cuda.can_device_access_peer(0, "cuda:1")
    assert torch.cuda.is_current_stream_capturing() is False
    assert torch.cuda.CUDAGraph is torch.npu.NPUGraph
    assert torch.cuda.graphs.graph is torch.npu.graph
    g = torch.cuda.CUDAGraph()
    x = torch.ones(2, device="cuda")
    with torch.cuda.graph(g):
        assert torch.cuda.is_current_stream_capturing()
        y = x * 2
    x.fill_(3)
    g.replay()
    assert y.tolist() == [6.0, 6.0]
    for call in (lambda: torch.cuda.utilization(0),):
        try:
            call()
        except RuntimeError as e:
            assert "opennpu" in str(e), e
        else:
            raise AssertionError("expected a RuntimeError")
    assert torch._utils._get_available_device_type() == "npu"


def check_cuda_memory_api():
    x = torch.empty(1 << 20, device="cuda")
    assert torch.cuda.memory_allocated() == torch.npu.memory_allocated() >= x.nbytes
    assert torch.cuda.memory_allocated("cuda:0") == torch.cuda.memory_allocated(torch.device("cuda:0"))
    assert torch.cuda.max_memory_allocated(0) >= x.nbytes
    assert torch.cuda.memory_reserved(0) >= x.nbytes
    assert torch.cuda.memory_stats("cuda:0")["allocated_bytes.all.current"] >= x.nbytes
    assert "Memory" in torch.cuda.memory_summary(torch.device("cuda:0")) or torch.cuda.memory_summary()
    free, total = torch.cuda.mem_get_info("cuda:0")
    assert 0 < free <= total
    torch.cuda.reset_peak_memory_stats("cuda:0")
    torch.cuda.set_per_process_memory_fraction(1.0, device=torch.device("cuda:0"))
    ptr = torch.cuda.caching_allocator_alloc(1024, "cuda:0")
    torch.cuda.caching_allocator_delete(ptr)
    del x
    torch.cuda.empty_cache()
    assert torch.cuda.memory.memory_allocated is not None


def check_streams_and_events():
    s = torch.cuda.Stream()
    assert isinstance(s, torch.npu.Stream) and s.device.type == "npu"
    assert torch.cuda.Stream(device="cuda:1").device == torch.device("npu", 1)
    assert isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
    with torch.cuda.stream(s):
        assert torch.cuda.current_stream() == s
        y = torch.ones(4, device="cuda") * 2
    assert torch.cuda.current_stream(0) == torch.npu.current_stream(0)
    assert torch.cuda.current_stream(torch.device("cuda:0")) == torch.npu.current_stream(0)
    assert torch.cuda.default_stream("cuda:0") == torch.npu.default_stream(0)
    assert isinstance(torch.npu.Event(), torch.cuda.Event) and isinstance(torch.cuda.Event(), torch.npu.Event)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y.sum().item()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0 and end.query()
    torch.cuda.current_stream().wait_stream(s)
    e = torch.Event("cuda:0")
    assert e.device.type == "npu" and isinstance(e, torch.Event)
    assert isinstance(torch.Event(device="cuda"), torch.Event)


def check_random():
    torch.cuda.manual_seed(7)
    a = torch.randn(5, device="cuda")
    torch.cuda.manual_seed_all(7)
    b = torch.randn(5, device="cuda")
    assert torch.equal(a, b)
    state = torch.cuda.get_rng_state("cuda:0")
    c = torch.rand(3, device="cuda")
    torch.cuda.set_rng_state(state, "cuda:0")
    assert torch.equal(c, torch.rand(3, device="cuda"))
    assert torch.cuda.default_generators is torch.npu.default_generators
    assert torch.cuda.initial_seed() == 7
    assert torch.cuda.random.manual_seed is not None
    for g in (torch.Generator("cuda"), torch.Generator(device="cuda:1"),
              torch.Generator(torch.device("cuda")), torch.Generator(device=torch.device("cuda", 0))):
        assert isinstance(g, torch.Generator) and g.device.type == "npu", g.device
    g = torch.Generator()
    assert g.device.type == "cpu" and isinstance(g, torch.Generator)
    assert isinstance(torch.default_generator, torch.Generator)
    assert isinstance(torch.npu.default_generators[0], torch.Generator)
    gen = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(4, generator=gen, device="cuda")
    torch.manual_seed(3)
    assert torch.equal(x.cpu(), torch.randn(4))


# -- device arguments -------------------------------------------------------------------------

def check_factory_device_arguments():
    specs = [("cuda", 0), ("cuda:1", 1), (torch.device("cuda"), 0), (torch.device("cuda", 1), 1), (1, 1)]
    for spec, index in specs:
        for make in (lambda d: torch.zeros(2, 3, device=d), lambda d: torch.ones(2, device=d),
                     lambda d: torch.empty(2, device=d), lambda d: torch.randn(2, device=d),
                     lambda d: torch.rand(2, device=d), lambda d: torch.arange(3, device=d),
                     lambda d: torch.full((2,), 1.5, device=d), lambda d: torch.eye(2, device=d),
                     lambda d: torch.tensor([1.0], device=d), lambda d: torch.linspace(0, 1, 3, device=d),
                     lambda d: torch.randint(1, 5, (2, 3), device=d), lambda d: torch.randperm(4, device=d),
                     lambda d: torch.zeros_like(torch.ones(2), device=d),
                     lambda d: torch.as_tensor([1, 2], device=d), lambda d: torch.fft.fftfreq(5, device=d)):
            _npu(make(spec), index)
    # Positional ints of other functions than to/to_empty are not devices.
    z = torch.zeros(1, 2)
    assert z.shape == (1, 2) and z.device.type == "cpu"
    assert torch.ones(3).device.type == "cpu" and torch.arange(0, 4, 2).tolist() == [0, 2]
    assert torch.UntypedStorage(4, device="cuda").device.type == "npu"
    assert torch.get_device_module("cuda:0") is torch.npu
    assert torch.get_device_module(torch.device("cuda")) is torch.npu


def check_tensor_to_and_new():
    a = torch.arange(4.0)
    _npu(a.to("cuda"), 0)
    _npu(a.to(1), 1)  # LOG: change device 1 of torch.Tensor.to to 'npu:1'
    _npu(a.to(device=1), 1)
    _npu(a.to(torch.device("cuda:1")), 1)
    _npu(a.to("cuda", torch.float16), 0)
    assert a.to("cuda", torch.float16).dtype == torch.float16
    assert a.to(int).dtype == torch.int64 and a.to(int).device.type == "cpu"
    assert a.to(float).dtype == torch.float64 and a.to(torch.bfloat16).dtype == torch.bfloat16
    b = a.to("cuda:0")
    assert b.to(a).device.type == "cpu"
    _npu(a.to(b), 0)
    _npu(a.new_zeros(2, device="cuda"))
    _npu(a.new_ones((2,), device="cuda:1"), 1)
    _npu(a.new_empty(2, device=torch.device("cuda")))
    _npu(a.new_full((2,), 3.0, device=0), 0)
    _npu(a.new_tensor([1.0], device="cuda"))
    _npu(a.new_empty_strided((2,), (1,), device="cuda"))
    assert a.new_zeros(3).device.type == "cpu"
    _npu(a.cuda(), 0)
    _npu(a.cuda(1), 1)
    _npu(a.cuda("cuda:1"), 1)
    _npu(a.cuda(device=torch.device("cuda:1")), 1)
    assert b.is_cuda and not a.is_cuda  # LOG: change attribute torch.Tensor.is_cuda
    assert b.is_npu
    pinned = torch.ones(4).pin_memory()
    assert pinned.is_pinned() and pinned.device.type == "cpu"


def check_modules():
    m = torch.nn.Linear(3, 2).cuda()  # LOG: change function torch.nn.Module.cuda to torch.nn.Module.npu
    _npu(m.weight, 0)
    m.cuda(1)
    _npu(m.weight, 1)
    m.to("cuda:0")
    _npu(m.weight, 0)
    m.to(1)
    _npu(m.weight, 1)
    m.to(torch.device("cuda"), dtype=torch.float64)
    assert m.weight.dtype == torch.float64
    m.to("cpu")
    assert m.weight.device.type == "cpu"
    e = torch.nn.Linear(3, 2, device="meta").to_empty(device="cuda")
    _npu(e.weight)
    lazy = torch.nn.LazyLinear(4).cuda()
    _npu(lazy(torch.ones(2, 5, device="cuda")))


def check_device_context_and_default():
    with torch.device("cuda"):
        _npu(torch.ones(2))
        _npu(torch.nn.Linear(2, 2).weight)
    with torch.device("cuda:1"):
        _npu(torch.zeros(1), 1)
    with torch.device("meta"):
        assert torch.nn.Linear(32, 8).weight.device.type == "meta"
    assert torch.ones(1).device.type == "cpu"
    try:
        torch.set_default_device("cuda")
        _npu(torch.tensor(1))
        assert torch.get_default_device().type == "npu"
    finally:
        torch.set_default_device(None)
    assert torch.tensor(1).device.type == "cpu"


def check_load_map_location():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "cuda_checkpoint.pt")  # a path naming cuda is not a device
        torch.save({"w": torch.arange(3.0, device="npu:1")}, path)
        for location, index in (("cuda", 0), ("cuda:0", 0), (torch.device("cuda:1"), 1),
                                ({"npu:1": "cuda:0"}, 0), (1, 1)):
            _npu(torch.load(path, map_location=location)["w"], index)
        _npu(torch.load(path, "cuda:0")["w"], 0)
        assert torch.load(path, map_location="cpu")["w"].device.type == "cpu"
        buffer = io.BytesIO()
        torch.save(torch.ones(2), buffer)
        buffer.seek(0)
        _npu(torch.load(buffer, map_location=lambda s, loc: s.npu()))
    # A checkpoint saved on a GPU: its storages carry "cuda:1".
    gpu_checkpoint = io.BytesIO()
    with mock.patch("torch.serialization.location_tag", lambda storage: "cuda:1"):
        torch.save({"w": torch.arange(3.0)}, gpu_checkpoint)
    for location, index in ((None, 1), ({"cuda:1": "cuda:0"}, 0), ("cuda:0", 0)):
        gpu_checkpoint.seek(0)
        w = torch.load(gpu_checkpoint, map_location=location)["w"]  # LOG: change storage location 'cuda:1' of torch.load to 'npu:1'
        _npu(w, index)
        assert w.tolist() == [0.0, 1.0, 2.0]
    gpu_checkpoint.seek(0)
    assert torch.load(gpu_checkpoint, map_location="cpu")["w"].device.type == "cpu"


def check_data_loader_pin_memory():
    data = torch.utils.data.TensorDataset(torch.arange(50.0).view(10, 5), torch.arange(10))
    for kwargs in ({}, {"pin_memory_device": "cuda"}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True, **kwargs)
            x, y = next(iter(loader))
        assert x.is_pinned() and y.is_pinned()
        _npu(x.cuda(non_blocking=True))


# -- amp --------------------------------------------------------------------------------------

def check_amp():
    a = torch.randn(3, 3, device="cuda")
    assert (a @ a).dtype == torch.float32
    with torch.autocast("cuda"):  # LOG: change device 'cuda' of torch.autocast to 'npu'
        assert (a @ a).dtype == torch.float16
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
    with torch.amp.autocast("cuda"):
        assert (a @ a).dtype == torch.float16
    with torch.cuda.amp.autocast():
        assert (a @ a).dtype == torch.float16
        assert torch.npu.is_autocast_enabled()
    with torch.cuda.amp.autocast(dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
    from torch.cuda.amp import GradScaler, autocast
    assert issubclass(GradScaler, torch.npu.amp.GradScaler) and issubclass(autocast, torch.npu.amp.autocast)
    assert torch.cuda.amp.autocast_mode is torch.npu.amp.autocast_mode
    assert torch.cuda.amp.grad_scaler is torch.npu.amp.grad_scaler
    assert torch.cuda.amp.common.amp_definitely_not_available() is False
    w = torch.ones(3, device="cuda", requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for scaler in (torch.cuda.amp.GradScaler(), torch.amp.GradScaler("cuda"),
                   torch.amp.GradScaler(device="cuda:0")):
        assert scaler.is_enabled()
        loss = (w * 2).sum()
        scaled = scaler.scale(loss)
        _npu(scaled)
        assert scaled.item() == loss.item() * scaler.get_scale()
        scaled.backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def check_backend_flags():
    old = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
           torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
    assert torch.backends.cudnn.benchmark
    x = torch.randn(1, 2, 5, 5, device="cuda")
    _npu(torch.nn.Conv2d(2, 3, 3).cuda()(x))
    (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
     torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) = old


# -- distributed ------------------------------------------------------------------------------

def check_distributed():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert dist.is_nccl_available()
    assert dist.ProcessGroupNCCL.Options().is_high_priority_stream is False
    assert dist.ProcessGroupNCCL is __import__("opennpu.distributed").distributed.ProcessGroupHCCL
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{d}/store", rank=0, world_size=1)  # LOG: change backend of torch.distributed.init_process_group from 'nccl' to 'hccl'
        try:
            assert dist.get_backend() == "hccl"
            t = torch.ones(3, device="cuda")
            dist.all_reduce(t)
            assert t.tolist() == [1.0, 1.0, 1.0]
            group = dist.new_group([0], backend="nccl")
            assert dist.get_backend(group) == "hccl"
            for ids in ([0], ("cuda:0",), [torch.device("cuda:0")]):
                model = DDP(torch.nn.Linear(2, 2).cuda(), device_ids=ids)
                model(torch.ones(1, 2, device="cuda")).sum().backward()
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method=f"file://{d}/store",
                                rank=0, world_size=1, device_id=torch.device("cuda:0"))
        try:
            assert dist.get_backend() == "cpu:gloo,npu:hccl", dist.get_backend()
            t = torch.ones(2, device="cuda")
            dist.all_reduce(t)
            c = torch.ones(2)
            dist.all_reduce(c)
        finally:
            dist.destroy_process_group()


# -- compilers --------------------------------------------------------------------------------

def check_compilers():
    def f(x):
        return x + 1

    assert torch.jit.script(f) is f and torch.jit.script_method(f) is f
    from torch.utils._triton import has_triton, has_triton_package
    assert has_triton() is False and has_triton_package() is False
    # Dynamo traces through the patched functions; a CUDA device inside the graph is npu.
    m = torch.nn.Linear(4, 4).cuda()

    def g(x):
        return m(x) + torch.ones(4, device="cuda")

    x = torch.randn(2, 4, device="cuda")
    out = torch.compile(g, backend="eager", fullgraph=True)(x)
    _npu(out)
    assert torch.equal(out, g(x))


# -- the log ----------------------------------------------------------------------------------

def check_log_once_per_call_site():
    for _ in range(3):
        torch.zeros(1, device="cuda")  # LOG: change argument device of torch.zeros from 'cuda' to 'npu'
    torch.cuda.synchronize()  # LOG: change function torch.cuda.synchronize to torch.npu.synchronize
    torch.ones(
        2,
        device="cuda:1",
    )  # END: torch.ones


def main():
    from torch_npu.contrib import transfer_to_npu  # noqa: F401
    from torch_npu.contrib import transfer_to_npu as again  # idempotent

    assert again is transfer_to_npu
    results = {}
    for name, fn in list(globals().items()):
        if name.startswith("check_") and callable(fn):
            try:
                fn()
                results[name] = "ok"
            except BaseException:
                results[name] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
