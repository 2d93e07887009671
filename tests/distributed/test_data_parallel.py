"""nn.DataParallel on npu devices in one process, as on torch_npu: replicas on npu:0 and npu:1,
the results and gradients of the module run alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.parallel as dp

import torch_npu  # noqa: F401

pytestmark = pytest.mark.skipif(torch.npu.device_count() < 2, reason="needs 2 npu devices")


def test_data_parallel_matches_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).npu(0)
    ref = copy.deepcopy(model)
    par = torch.nn.DataParallel(model, device_ids=[0, 1])
    x = torch.randn(12, 10, device="npu:0")
    out = par(x)
    expected = ref(x)
    assert out.device == torch.device("npu", 0)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.device == torch.device("npu", 0)
        torch.testing.assert_close(p.grad, q.grad)


def test_data_parallel_function_and_cpu_input():
    fc = torch.nn.Linear(10, 5).npu(0)
    x = torch.randn(20, 10, device="npu:0")
    torch.testing.assert_close(dp.data_parallel(fc, x, [0, 1]), fc(x))
    out = torch.nn.DataParallel(fc, device_ids=[0, 1])(x.cpu())  # CPU input, scattered to npu
    assert out.device == torch.device("npu", 0)
    torch.testing.assert_close(out, fc(x))


def test_parallel_apply_runs_each_replica_on_its_device():
    from torch_npu.utils._module import _parallel_apply

    class Where(torch.nn.Module):
        def forward(self, x):
            return x + torch.npu.current_device()

    xs = [torch.zeros(2, device="npu:0"), torch.zeros(2, device="npu:1")]
    outs = _parallel_apply([Where(), Where()], [(xs[0],), (xs[1],)], None, [0, 1])
    assert [o.device.index for o in outs] == [0, 1]
    assert [o[0].item() for o in outs] == [0.0, 1.0]


def test_comm_copies_between_npu_devices():
    from torch.nn.parallel import comm

    t = torch.arange(6.0, device="npu:0").view(3, 2)
    a, b = comm.scatter(t, [0, 1], chunk_sizes=[2, 1])
    assert (a.device.index, b.device.index) == (0, 1) and a.data_ptr() == t.data_ptr()
    torch.testing.assert_close(comm.gather([a, b], destination=1).cpu(), t.cpu())
    assert comm.gather([a, b], destination=-1).device.type == "cpu"
    copies = comm.broadcast_coalesced([t, t[0]], [0, 1])
    assert [c[0].device.index for c in copies] == [0, 1]
