"""nn.LSTM / GRU / LSTMCell / GRUCell on npu: ATen sends accelerator tensors to the fused cells
(_thnn_fused_lstm_cell, _thnn_fused_gru_cell and their backwards), which opennpu provides on npu.
Outputs and gradients equal CPU's unfused cells within float32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

RNNS = {
    "lstm": lambda bias: nn.LSTM(6, 5, num_layers=2, bias=bias, batch_first=True, bidirectional=True),
    "gru": lambda bias: nn.GRU(6, 5, num_layers=2, bias=bias, bidirectional=True),
    "lstm_cell": lambda bias: nn.LSTMCell(6, 5, bias=bias),
    "gru_cell": lambda bias: nn.GRUCell(6, 5, bias=bias),
}


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _run(module, x, state):
    """Forward, then backward of a loss over every output (the sequence and the final states)."""
    out = module(x, state) if state is not None else module(x)
    sum(t.square().sum() for t in _flat(out)).backward()
    return out


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("kind", list(RNNS))
def test_rnn_forward_and_backward_match_cpu(kind, bias):
    cpu = RNNS[kind](bias)
    npu = copy.deepcopy(cpu).npu()
    cell = kind.endswith("cell")
    x = torch.randn(3, 6) if cell else torch.randn(3, 4, 6)
    hx = torch.randn(3, 5)
    state = ((hx, torch.randn(3, 5)) if kind == "lstm_cell" else hx) if cell else None
    x_cpu, x_npu = x.clone().requires_grad_(), x.npu().requires_grad_()
    to_npu = (lambda s: tuple(t.npu() for t in s) if isinstance(s, tuple) else s.npu())
    want = _run(cpu, x_cpu, state)
    got = _run(npu, x_npu, to_npu(state) if state is not None else None)
    for g, w in zip(_flat(got), _flat(want)):
        assert g.device.type == "npu"
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_npu.grad.cpu(), x_cpu.grad, rtol=1e-5, atol=1e-6)
    for (name, p_npu), p_cpu in zip(npu.named_parameters(), cpu.parameters()):
        assert p_npu.grad.device.type == "npu", name
        torch.testing.assert_close(p_npu.grad.cpu(), p_cpu.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_packed_sequences_on_npu():
    lstm = nn.LSTM(4, 3, batch_first=True)
    x, lengths = torch.randn(3, 5, 4), torch.tensor([5, 3, 2])
    want, _ = pad_packed_sequence(lstm(pack_padded_sequence(x, lengths, batch_first=True))[0],
                                  batch_first=True)
    lstm.npu()
    got, _ = pad_packed_sequence(lstm(pack_padded_sequence(x.npu(), lengths, batch_first=True))[0],
                                 batch_first=True)
    assert got.device.type == "npu"
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_fused_cells_gradcheck(kind):
    """The fused cells' backward formulas, in float64 against finite differences."""
    torch.manual_seed(0)
    gates, hidden = (4, 3) if kind == "lstm" else (3, 3)
    ig = torch.randn(2, gates * hidden, dtype=torch.float64, device="npu", requires_grad=True)
    hg = torch.randn(2, gates * hidden, dtype=torch.float64, device="npu", requires_grad=True)
    state = torch.randn(2, hidden, dtype=torch.float64, device="npu", requires_grad=True)
    b1 = torch.randn(gates * hidden, dtype=torch.float64, device="npu", requires_grad=True)
    b2 = torch.randn(gates * hidden, dtype=torch.float64, device="npu", requires_grad=True)
    if kind == "lstm":
        fn = lambda *a: torch.ops.aten._thnn_fused_lstm_cell(*a)[:2]  # noqa: E731
    else:
        fn = lambda *a: torch.ops.aten._thnn_fused_gru_cell(*a)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (ig, hg, state, b1, b2))
    assert torch.autograd.gradcheck(fn, (ig, hg, state))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cells_are_as_accurate_as_cpu(dtype):
    """fp16 / bf16 cells compute in float32 and round once: no further from the float32 result
    than ATen's CPU cells, which round after every op. (With oneDNN, as for bf16 on an
    AVX512_BF16 CPU, CPU's LSTM keeps its state in float32 across steps and can be closer: it
    is not the composition this replaces, so oneDNN is off for the comparison.)"""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8)
    x = torch.randn(6, 2, 8)
    ref = lstm(x)[0].double()
    low = copy.deepcopy(lstm).to(dtype)
    with torch.backends.mkldnn.flags(enabled=False):
        cpu_err = (low(x.to(dtype))[0].double() - ref).abs().max()
    npu_err = (low.npu()(x.to(dtype).npu())[0].cpu().double() - ref).abs().max()
    assert npu_err <= cpu_err * 1.05 + 1e-6, (npu_err, cpu_err)


def test_fused_cell_errors_name_the_op_and_argument():
    ig = torch.randn(2, 12, device="npu")
    with pytest.raises(RuntimeError, match=r"_thnn_fused_lstm_cell: input_gates and hidden_gates"):
        torch.ops.aten._thnn_fused_lstm_cell(ig, torch.randn(2, 8, device="npu"), torch.randn(2, 3, device="npu"))
    with pytest.raises(RuntimeError, match=r"_thnn_fused_gru_cell: the state must be \[batch, hidden\]"):
        torch.ops.aten._thnn_fused_gru_cell(ig, ig, torch.randn(2, 5, device="npu"))
    with pytest.raises(RuntimeError, match="input_bias and hidden_bias must both be given"):
        torch.ops.aten._thnn_fused_gru_cell(ig, ig, torch.randn(2, 4, device="npu"), torch.zeros(12, device="npu"))
