"""npu tensors: factories, cross-device copies, and zero-copy execution with PyTorch's aliasing."""

from __future__ import annotations

import pytest
import torch


def copies() -> int:
    return torch.ops.opennpu._npu_copy_stats()[0]


def test_factories_land_on_npu():
    for t in (torch.empty(3, device="npu"), torch.zeros(2, 3, device="npu"),
              torch.ones(4, device="npu:1"), torch.arange(5, device="npu"),
              torch.full((2,), 7.0, device="npu"), torch.eye(3, device="npu"),
              torch.randn(4, device="npu"), torch.linspace(0, 1, 5, device="npu"),
              torch.tril_indices(3, 3, device="npu")):
        assert t.device.type == "npu", t
    assert torch.ones(4, device="npu:1").device.index == 1
    torch.testing.assert_close(torch.arange(5, device="npu").cpu(), torch.arange(5))
    torch.testing.assert_close(torch.eye(3, device="npu").cpu(), torch.eye(3))


def test_copies_between_devices():
    x = torch.randn(3, 4)
    y = x.npu()
    assert y.device == torch.device("npu:0")
    torch.testing.assert_close(y.cpu(), x)
    z = y.to("npu:1")
    assert z.device == torch.device("npu:1") and z.data_ptr() != y.data_ptr()
    torch.testing.assert_close(z.cpu(), x)
    w = torch.empty(4, 3, device="npu")
    w.copy_(y.t())
    torch.testing.assert_close(w.cpu(), x.t())
    assert y.to("npu:0", torch.float64).dtype == torch.float64
    torch.testing.assert_close(y.to(torch.float16).cpu(), x.to(torch.float16))
    torch.testing.assert_close(y.to("cpu", non_blocking=True), x)
    c = torch.empty(3, 4)
    c.copy_(y)
    torch.testing.assert_close(c, x)


def test_ops_copy_nothing_and_outputs_come_from_the_npu_pool():
    a = torch.randn(64, 32).npu()
    b = torch.randn(32, 16).npu()
    before = copies()
    allocated = torch.npu.memory_allocated()
    out = torch.nn.functional.gelu(a @ b + 1).softmax(-1).sum(0)
    assert out.device.type == "npu"
    assert copies() == before
    assert torch.npu.memory_allocated() >= allocated + out.numel() * 4


def test_results_equal_cpu():
    x = torch.randn(5, 7)
    y = torch.randn(7)
    for fn in (lambda a, b: a + b, lambda a, b: a * 2.5 - b, lambda a, b: (a @ b).exp(),
               lambda a, b: torch.where(a > 0, a, b), lambda a, b: a.half() + b,
               lambda a, b: a.max(dim=1).values, lambda a, b: a.sort(dim=1).indices,
               lambda a, b: a[a > 0], lambda a, b: torch.cat([a, a]).std(0)):
        expected = fn(x, y)
        actual = fn(x.npu(), y.npu())
        assert actual.device.type == "npu"
        torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)


def test_views_share_npu_memory():
    x = torch.arange(12.0, device="npu")
    before = copies()
    for view in (x.view(3, 4), x.view(3, 4).t(), x[2:5], x.reshape(2, 6), x.view(3, 4)[:, 1],
                 x.unflatten(0, (2, 6)), x.view(3, 4).diagonal(), x.unfold(0, 4, 2), x.as_strided((2,), (3,)),
                 x.view(3, 4).select(1, 2), x.view(3, 4).unbind(0)[1], x.view(3, 4).split(2)[1]):
        assert view.device == x.device
        assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert view._base is x
    x.view(3, 4)[:, 1].fill_(-1)
    assert copies() == before
    assert x.cpu()[1::4].eq(-1).all()


def test_in_place_ops_return_the_same_tensor():
    x = torch.ones(4, device="npu")
    ptr = x.data_ptr()
    y = x.add_(1)
    assert y is x and x.data_ptr() == ptr
    x.mul_(torch.tensor(3.0))  # a 0-dim CPU tensor is accepted, as on CUDA
    torch.testing.assert_close(x.cpu(), torch.full((4,), 6.0))
    x.t_()
    x.unsqueeze_(0)
    assert x.shape == (1, 4) and x.device.type == "npu" and x.data_ptr() == ptr


def test_out_variant_writes_into_npu_memory_and_resizes_on_npu():
    a = torch.randn(8).npu()
    out = torch.empty(8, device="npu")
    ptr = out.data_ptr()
    r = torch.add(a, a, out=out)
    assert r is out and out.data_ptr() == ptr
    grown = torch.empty(0, device="npu:1")
    torch.mul(a.to("npu:1"), 2, out=grown)
    assert grown.shape == (8,) and grown.device == torch.device("npu:1")
    torch.testing.assert_close(grown.cpu(), a.cpu() * 2)
    assert grown.untyped_storage().device == torch.device("npu:1")


def test_resize_and_set():
    x = torch.arange(4.0, device="npu")
    x.resize_(10)
    assert x.shape == (10,) and x.device.type == "npu"
    torch.testing.assert_close(x[:4].cpu(), torch.arange(4.0))
    y = torch.empty(0, device="npu")
    y.set_(x.untyped_storage(), 2, (2, 2), (2, 1))
    assert y.data_ptr() == x.data_ptr() + 8
    z = torch.empty(0, device="npu").set_(x)
    assert z.data_ptr() == x.data_ptr() and z.shape == x.shape
    e = torch.ones(3, device="npu").set_()
    assert e.numel() == 0 and e.device.type == "npu"


def test_item_and_printing():
    x = torch.tensor([1.5, -2.0]).npu()
    assert x[0].item() == 1.5
    assert x.tolist() == [1.5, -2.0]
    assert "device='npu:0'" in repr(x)


def test_mixed_devices_raise_the_same_device_error():
    x = torch.ones(3, device="npu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3) + x
    with pytest.raises(RuntimeError, match="npu:0 and npu:1"):
        x + torch.ones(3, device="npu:1")
    torch.testing.assert_close((x + torch.tensor(2.0)).cpu(), torch.full((3,), 3.0))
    # CPU indices are accepted, as with CUDA tensors
    torch.testing.assert_close(x[torch.tensor([0, 2])].cpu(), torch.ones(2))


def test_bad_device_index():
    with pytest.raises(RuntimeError, match="Invalid device index npu:8"):
        torch.ones(2, device="npu:8")
    with pytest.raises(RuntimeError, match="Invalid device index"):
        torch.npu.set_device(99)
    with pytest.raises(RuntimeError, match="Invalid device index"):
        torch.npu.synchronize(8)


def test_several_devices_stay_apart():
    with torch.npu.device(1):
        assert torch.npu.current_device() == 1
        x = torch.ones(3, device="npu")
        assert x.device == torch.device("npu:1")
    assert torch.npu.current_device() == 0
    y = (x * 2).sum()
    assert y.device == torch.device("npu:1")
    with torch.npu.device_of(y):
        assert torch.npu.current_device() == 1
    assert torch.npu.current_device() == 0
    torch.npu.set_device("npu:2")
    try:
        assert torch.npu.current_device() == 2
        assert torch.zeros(1, device="npu").device.index == 2
    finally:
        torch.npu.set_device(torch.device("npu:0"))


def test_autograd_runs_on_npu():
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    wn = w.detach().npu().requires_grad_()
    loss_cpu = (x @ w).tanh().pow(2).mean()
    loss_npu = (x.npu() @ wn).tanh().pow(2).mean()
    loss_cpu.backward()
    loss_npu.backward()
    assert wn.grad.device.type == "npu"
    torch.testing.assert_close(wn.grad.cpu(), w.grad, rtol=0, atol=0)


def test_arithmetic_fast_path_keeps_cpu_semantics():
    x = torch.arange(6.0).npu()
    i = torch.arange(6).npu()
    # type promotion, wrapped Python numbers, 0-dim CPU tensors on either side
    for got, want in (((x + i), torch.arange(6.0) * 2), ((i * 2.5), torch.arange(6) * 2.5),
                      ((torch.tensor(1.0) - x), 1.0 - torch.arange(6.0)),
                      ((i / 2), torch.arange(6) / 2), ((x - i).dtype, torch.float32)):
        if isinstance(got, torch.Tensor):
            assert got.device.type == "npu"
            got = got.cpu()
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
    y = x.clone()
    ptr = y.data_ptr()
    assert y.add_(y, alpha=2) is y and y.data_ptr() == ptr
    torch.testing.assert_close(y.cpu(), torch.arange(6.0) * 3)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        y[1:].add_(y[:-1])  # partial overlap, rejected as on CPU
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(6).add_(x)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x.mul(torch.ones(6))
    y.mul_(torch.tensor(0.5)).div_(torch.tensor([1.0, 2, 3, 4, 5, 6]).npu())
    torch.testing.assert_close(y.cpu(), torch.arange(6.0) * 1.5 / torch.arange(1.0, 7))


def test_unboxed_kernels_match_cpu_and_hand_unusual_calls_to_the_fallback():
    fallback = torch.ops.opennpu._npu_fallback_stats
    torch.manual_seed(0)
    a, b, c = torch.randn(5, 7), torch.randn(7, 3), torch.randn(5, 3)
    an, bn, cn = a.npu(), b.npu(), c.npu()
    before = fallback()[0]
    for got, want in ((torch.addmm(cn, an, bn, beta=0.5), torch.addmm(c, a, b, beta=0.5)),
                      (torch.mm(an, bn), torch.mm(a, b)), (torch.nn.functional.gelu(an), torch.nn.functional.gelu(a)),
                      (torch.ops.aten.gelu_backward(an, an, approximate="tanh"),
                       torch.ops.aten.gelu_backward(a, a, approximate="tanh")),
                      (an.sum(1, keepdim=True, dtype=torch.float64), a.sum(1, keepdim=True, dtype=torch.float64)),
                      (torch.nn.functional.mse_loss(cn, cn * 2), torch.nn.functional.mse_loss(c, c * 2)),
                      (an.t().sqrt(), a.t().sqrt()), (an * 3, a * 3)):
        assert got.device.type == "npu"
        assert torch.equal(got.cpu(), want) or torch.allclose(got.cpu(), want, equal_nan=True)
    # in-place on views and overlapping arguments, 0-dim CPU tensors, foreach lists sharing storage
    x, xn = a.clone(), a.clone().npu()
    ptr = xn.data_ptr()
    assert xn[1:].lerp_(xn[:-1].clone(), 0.25) is not None and xn.data_ptr() == ptr
    x[1:].lerp_(x[:-1].clone(), 0.25)
    y = xn.addcdiv_(xn, an * an + 1, value=0.5)
    assert y is xn
    x.addcdiv_(x, a * a + 1, value=0.5)
    xn.addcmul_(an, torch.tensor(2.0), value=-1)
    x.addcmul_(a, torch.tensor(2.0), value=-1)
    lists = [xn[:2], xn[2:], bn]
    torch._foreach_mul_(lists, 0.5)
    torch._foreach_lerp_(lists, [t.clone() for t in lists], 0.1)
    torch._foreach_addcdiv_(lists, lists, [t * t + 1 for t in lists], [0.1, 0.2, 0.3])
    roots = list(torch._foreach_sqrt([t * t for t in lists]))
    ref = [x[:2], x[2:], b.clone()]
    torch._foreach_mul_(ref, 0.5)
    torch._foreach_lerp_(ref, [t.clone() for t in ref], 0.1)
    torch._foreach_addcdiv_(ref, ref, [t * t + 1 for t in ref], [0.1, 0.2, 0.3])
    for got, want in zip(lists + roots, ref + list(torch._foreach_sqrt([t * t for t in ref]))):
        assert got.device.type == "npu" and torch.equal(got.cpu(), want)
    assert xn.fill_(3.0) is xn and torch.equal(xn.cpu(), torch.full((5, 7), 3.0))
    assert fallback()[0] == before  # none of these took the boxed fallback
    # unusual calls take the fallback and fail or succeed as it does
    with pytest.raises(RuntimeError, match="argument 'mat2' of aten::mm"):
        torch.mm(an, b)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch._foreach_mul_([an, a], 2.0)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        an.lerp_(a, 0.5)
    assert fallback()[0] > before


def test_untyped_storage_on_npu():
    s = torch.UntypedStorage(8, device="npu")
    assert s.device.type == "npu" and s.nbytes() == 8
    t = torch.tensor([1.0, 2.0]).npu()
    storage = t.untyped_storage()
    storage.resize_(16)  # through the hooks' resizePrivateUse1Bytes, keeping the first bytes
    assert storage.nbytes() == 16 and storage.device.type == "npu"
    assert torch.empty(0, device="npu").set_(storage, 0, (2,), (1,)).tolist() == [1.0, 2.0]
    assert storage.cpu().device.type == "cpu"


def test_lazy_modules_move_to_npu_before_materialisation():
    layer = torch.nn.LazyLinear(4).npu()
    y = layer(torch.randn(2, 3, device="npu"))
    assert y.device.type == "npu" and layer.weight.shape == (4, 3) and layer.weight.is_npu
