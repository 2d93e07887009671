"""torch.npu graph capture (NPUGraph, torch.npu.graph, make_graphed_callables, task-group update):
an emulation with CUDA-graph semantics, src/opennpu/npu/graphs.py."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
import torch.nn.functional as F

import torch_npu

NOT_PERMITTED = "operation not permitted when stream is capturing"


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 5)).npu()


def test_mlp_replay_follows_static_input():
    model = _mlp()
    x = torch.randn(3, 6, device="npu")
    g = torch.npu.NPUGraph()
    with torch.no_grad(), torch.npu.graph(g):
        y = model(x)
    ptr = y.data_ptr()
    for _ in range(2):
        x.copy_(torch.randn(3, 6))
        g.replay()
        with torch.no_grad():
            expected = model(x)
        assert y.data_ptr() == ptr  # the captured output is updated in place
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
    # parameters are static inputs too
    with torch.no_grad():
        model[0].weight.mul_(-1)
        expected = model(x)
    g.replay()
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_inplace_view_and_out_ops():
    x = torch.randn(4, 3, device="npu")
    x_old = x.cpu()
    acc = torch.zeros(3, 4, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        t = x.t()                      # a view: not re-run, still aliases x
        y = t * 2
        y.add_(1)                      # in place: re-run
        row = y[1]                     # a view of an intermediate
        out = torch.empty(4, device="npu")
        torch.mul(row, 3, out=out)     # out=: re-run
        acc.add_(t)                    # accumulates once per replay, as on the device
    x_new = torch.randn(4, 3)
    x.copy_(x_new)
    g.replay()
    ref = x_new.t() * 2 + 1
    torch.testing.assert_close(y.cpu(), ref)
    torch.testing.assert_close(row.cpu(), ref[1])
    torch.testing.assert_close(out.cpu(), ref[1] * 3)
    assert t.data_ptr() == x.data_ptr()
    g.replay()
    torch.testing.assert_close(y.cpu(), ref)  # functional results do not compound
    # acc: once at capture (with the old x), twice at replay (with the new x)
    torch.testing.assert_close(acc.cpu(), x_old.t() + 2 * x_new.t())
    kinds = {str(r.func): r.kind for r in g._records}
    assert kinds["aten.t.default"] == "view" and kinds["aten.add_.Tensor"] == "mutate"
    assert kinds["aten.mul.out"] == "mutate" and kinds["aten.empty.memory_format"] == "alloc"


def test_inplace_on_static_input_accumulates_per_replay():
    x = torch.ones(5, device="npu")
    acc = torch.zeros(5, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        acc.add_(x)
    assert acc.cpu().tolist() == [1.0] * 5
    x.fill_(2)
    g.replay()
    g.replay()
    assert acc.cpu().tolist() == [5.0] * 5


def test_npu_fused_op_rms_norm():
    x = torch.randn(4, 32, device="npu", dtype=torch.float16)
    gamma = torch.randn(32, device="npu", dtype=torch.float16)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        y, rstd = torch_npu.npu_rms_norm(x, gamma, epsilon=1e-5)
        z = y.float().sum(-1)
    x.copy_(torch.randn(4, 32, dtype=torch.float16))
    g.replay()
    y_ref, rstd_ref = torch_npu.npu_rms_norm(x, gamma, epsilon=1e-5)
    assert torch.equal(y.cpu(), y_ref.cpu()) and torch.equal(rstd.cpu(), rstd_ref.cpu())
    torch.testing.assert_close(z.cpu(), y_ref.float().sum(-1).cpu())
    assert any(str(r.func) == "npu.npu_rms_norm.default" for r in g._records)


def test_random_ops_draw_again_and_follow_the_rng_state():
    # (aten's dropout kernel on npu draws from the CPU generator today, randn from the npu one:
    # both states are saved and restored)
    def get_state():
        return torch.get_rng_state(), torch.npu.get_rng_state()

    def set_state(state):
        torch.set_rng_state(state[0])
        torch.npu.set_rng_state(state[1])

    x = torch.ones(64, 64, device="npu")
    torch.npu.manual_seed(5)
    state = get_state()
    eager1 = F.dropout(x, 0.5, training=True)
    eager2 = F.dropout(x, 0.5, training=True)
    assert not torch.equal(eager1.cpu(), eager2.cpu())
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        y = F.dropout(x, 0.5, training=True)
        n = torch.randn(8, device="npu")
    captured = y.clone()
    g.replay()
    assert not torch.equal(y.cpu(), captured.cpu())  # fresh draws at every replay
    set_state(state)
    g.replay()
    first = y.clone()
    n1 = n.clone()
    set_state(state)
    torch.testing.assert_close(first, F.dropout(x, 0.5, training=True), rtol=0, atol=0)
    torch.testing.assert_close(n1, torch.randn(8, device="npu"), rtol=0, atol=0)


def test_fusion_attention_dropout_forward_and_backward_replay_eager():
    """npu_fusion_attention returns its dropout seed / offset as ints, which its gradient op
    takes: at replay the backward must use what the replayed forward drew."""
    q, k, v = (torch.randn(1, 16, 64, device="npu", requires_grad=True) for _ in range(3))
    dy = torch.randn(1, 16, 64, device="npu")

    def step():
        out = torch_npu.npu_fusion_attention(q, k, v, 2, "BSH", scale=0.125, keep_prob=0.7)[0]
        out.backward(dy)
        return out

    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        out = step()
    grads = [t.grad for t in (q, k, v)]
    state = (torch.get_rng_state(), torch.npu.get_rng_state())
    g.replay()
    replayed = [out.clone()] + [t.clone() for t in grads]
    torch.set_rng_state(state[0])
    torch.npu.set_rng_state(state[1])
    for t in (q, k, v):
        t.grad = None
    eager = [step().detach()] + [t.grad for t in (q, k, v)]
    for a, b in zip(replayed, eager):
        torch.testing.assert_close(a, b)
    assert not torch.equal(replayed[0].cpu(), out.new_zeros(()).expand_as(out).cpu())


@pytest.mark.parametrize("sync", ["item", "cpu", "tolist", "synchronize", "nonzero",
                                  "stream_synchronize", "equal", "bool"])
def test_host_synchronisation_during_capture_raises(sync):
    x = torch.randn(4, device="npu")
    calls = {
        "item": lambda: x.sum().item(),
        "cpu": lambda: x.cpu(),
        "tolist": lambda: x.tolist(),
        "synchronize": lambda: torch.npu.synchronize(),
        "nonzero": lambda: torch.nonzero(x),
        "stream_synchronize": lambda: torch.npu.current_stream().synchronize(),
        "equal": lambda: torch.equal(x, x),
        "bool": lambda: bool(x.sum() > 0),
    }
    g = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match=NOT_PERMITTED):
        with torch.npu.graph(g):
            y = x * 2
            calls[sync]()
    assert not torch.npu.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    # the failed capture left nothing behind: another graph captures and replays
    g2 = torch.npu.NPUGraph()
    with torch.npu.graph(g2):
        y = x * 2
    g2.replay()
    torch.testing.assert_close(y, x * 2)


def test_capture_in_inference_mode_replays_outside_it():
    """vllm-ascend captures under torch.inference_mode; a replay outside it still writes the
    (inference) static outputs."""
    model = _mlp()
    x = torch.randn(2, 6, device="npu")
    g = torch.npu.NPUGraph()
    with torch.inference_mode():
        static_x = x.clone()
        with torch.npu.graph(g):
            y = model(static_x)
    assert y.is_inference()
    new = torch.randn(2, 6, device="npu")
    with torch.inference_mode():
        static_x.copy_(new)
    g.replay()
    with torch.no_grad():
        torch.testing.assert_close(y, model(new), rtol=0, atol=0)


def test_cpu_work_during_capture_is_allowed_and_not_recorded():
    x = torch.randn(4, device="npu")
    c = torch.arange(4.0)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        assert c.sum().item() == 6.0   # CPU tensors: not a device synchronisation
        y = x + c.npu()                # host-to-device copy: recorded, re-read at replay
    assert all(r.func is not torch.ops.aten.sum.default for r in g._records)
    c.fill_(10)
    g.replay()
    torch.testing.assert_close(y.cpu(), x.cpu() + 10)


def test_capture_rules():
    g = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    with pytest.raises(RuntimeError, match="capture_end\\(\\) called before capture_begin"):
        g.capture_end()
    with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
        g.capture_begin()
    s1, s2 = torch.npu.Stream(), torch.npu.Stream()
    with torch.npu.stream(s1):
        with pytest.raises(RuntimeError, match="capture_error_mode must be one of"):
            g.capture_begin(capture_error_mode="strict")
        g.capture_begin()
        other = torch.npu.NPUGraph()
        with pytest.raises(RuntimeError, match="another NPUGraph is capturing"):
            other.capture_begin()
        with torch.npu.stream(s2):
            with pytest.raises(RuntimeError, match="same stream it began on"):
                g.capture_end()
        y = torch.ones(2, device="npu") * 3
        g.capture_end()
        with pytest.raises(RuntimeError, match="already owns a captured graph"):
            g.capture_begin()
    y.zero_()
    g.replay()
    assert y.cpu().tolist() == [3.0, 3.0]
    kept = torch.npu.NPUGraph(keep_graph=True)  # torch.cuda.CUDAGraph's argument
    with pytest.raises(RuntimeError, match="instantiate without a preceding successful capture"):
        kept.instantiate()


def test_reset_releases_the_graph():
    x = torch.randn(8, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        hidden = x.exp()
        y = hidden + 1
    ref = weakref.ref(hidden)
    del hidden
    gc.collect()
    assert ref() is not None  # the graph holds its intermediates (its pool)
    g.reset()
    gc.collect()
    assert ref() is None
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    with torch.npu.graph(g):  # a reset graph captures again
        y = x * 4
    g.replay()
    torch.testing.assert_close(y, x * 4)


def test_is_current_stream_capturing():
    assert torch.npu.is_current_stream_capturing() is False
    side = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=side):
        assert torch.npu.is_current_stream_capturing() is True
        with torch.npu.stream(torch.npu.Stream()):
            assert torch.npu.is_current_stream_capturing() is False
    assert torch.npu.is_current_stream_capturing() is False


def test_graph_pool_handle_sharing():
    pool = torch.npu.graph_pool_handle()
    assert pool != torch.npu.graph_pool_handle()
    x = torch.randn(3, device="npu")
    g1, g2 = torch.npu.NPUGraph(), torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="pool\\(\\) without a preceding successful capture"):
        g1.pool()
    with torch.npu.graph(g1, pool=pool):
        a = x + 1
    assert g1.pool() == pool
    with torch.npu.graph(g2, pool=g1.pool()):
        b = a * 2
    x.fill_(1)
    g1.replay()
    g2.replay()
    assert b.cpu().tolist() == [4.0] * 3
    g3 = torch.npu.NPUGraph()
    with torch.npu.stream(torch.npu.Stream()):
        with pytest.raises(TypeError, match="pool must be a token"):
            g3.capture_begin(pool="shared")
    assert g3.pool.__doc__  # a method, as in torch_npu


def test_graph_context_manager_streams():
    before = torch.npu.current_stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        default_side = torch.npu.current_stream()
        y = torch.full((2,), 7.0, device="npu")
    assert default_side != torch.npu.default_stream()
    assert torch.npu.current_stream() == before
    mine = torch.npu.Stream()
    g2 = torch.npu.NPUGraph()
    with torch.npu.graph(g2, stream=mine):
        assert torch.npu.current_stream() == mine
        z = y * 2
    assert torch.npu.current_stream() == before
    y.fill_(1)
    g2.replay()  # replay on the default stream is fine
    assert z.cpu().tolist() == [2.0, 2.0]
    with pytest.raises(TypeError, match="must be a torch.npu.NPUGraph"):
        torch.npu.graph(object())


def test_backward_inside_capture():
    w = torch.randn(5, 3, device="npu", requires_grad=True)
    x = torch.randn(4, 5, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        loss = (x @ w).tanh().sum()
        loss.backward()
    grad = w.grad
    x.copy_(torch.randn(4, 5))
    g.replay()
    w2 = w.detach().clone().requires_grad_()
    (x @ w2).tanh().sum().backward()
    assert w.grad is grad
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(loss.detach(), (x @ w2).tanh().sum().detach())


def test_compiled_function_inside_capture():
    @torch.compile(backend="inductor", fullgraph=True)
    def f(a, b):
        return torch.relu(a @ b) + a.sum(-1, keepdim=True)

    a = torch.randn(4, 4, device="npu")
    b = torch.randn(4, 4, device="npu")
    f(a, b)  # compiled before the capture
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        y = f(a, b)
    assert len(g._records) > 1  # the ops ran through the dispatcher and were recorded
    a.copy_(torch.linspace(-2, 2, 16).reshape(4, 4))
    g.replay()
    torch.testing.assert_close(y, torch.relu(a @ b) + a.sum(-1, keepdim=True))


def test_make_graphed_callables_module_and_function():
    model = _mlp()
    ref = _mlp()
    x = torch.randn(3, 6, device="npu", requires_grad=True)
    graphed = torch.npu.make_graphed_callables(model, (x,))
    assert graphed is model
    for _ in range(3):
        # as with CUDA graphs, a parameter's first .grad may be the graph's static gradient
        # (AccumulateGrad takes it), so gradients are reset between steps, as in training loops
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        data = torch.randn(3, 6, device="npu", requires_grad=True)
        data_ref = data.detach().clone().requires_grad_()
        out = graphed(data)
        out_ref = ref(data_ref)
        torch.testing.assert_close(out, out_ref)
        out.pow(2).sum().backward()
        out_ref.pow(2).sum().backward()
        torch.testing.assert_close(data.grad, data_ref.grad)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    model.eval()  # not the captured mode: runs eagerly
    assert not torch.npu.is_current_stream_capturing()

    def fn(a, b):
        return a * b + 1

    a = torch.randn(4, device="npu", requires_grad=True)
    b = torch.randn(4, device="npu")
    gfn = torch.npu.make_graphed_callables(fn, (a, b))
    a2, b2 = torch.randn(4, device="npu", requires_grad=True), torch.randn(4, device="npu")
    y = gfn(a2, b2)
    y.sum().backward()
    torch.testing.assert_close(y, a2 * b2 + 1)
    torch.testing.assert_close(a2.grad, b2)
    with pytest.raises(RuntimeError, match="must contain only Tensors"):
        torch.npu.make_graphed_callables(fn, (a, 2.0))


def test_task_group_update_replaces_recorded_calls():
    x = torch.randn(6, device="npu")
    out = torch.empty(6, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        stream = torch.npu.current_stream()
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        torch.mul(x, 2.0, out=out)
        handle = torch.npu.graph_task_group_end(stream)
        y = out + 1
    update_stream = torch.npu.Stream()
    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, handle)
        returned = torch.mul(x, 3.0, out=out)
        torch.npu.graph_task_update_end(update_stream)
        event.record(update_stream)
    assert returned is out
    torch.testing.assert_close(out, x * 2)  # the update does not run now
    g.replay()
    torch.testing.assert_close(out, x * 3)
    torch.testing.assert_close(y, x * 3 + 1)
    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, handle)
        with pytest.raises(RuntimeError, match="was aten.mul.out at capture"):
            torch.add(x, 3.0, out=out)
        with pytest.raises(RuntimeError, match="recorded 1 call\\(s\\) but the update made 0"):
            torch.npu.graph_task_update_end(update_stream)
    with pytest.raises(RuntimeError, match="stream is not capturing"):
        torch.npu.graph_task_group_begin(update_stream)


def _fia(q, k, v, lengths, **kw):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, input_layout="BNSD", scale=0.125, softmax_lse_flag=False,
        actual_seq_lengths_kv=lengths, **kw)


def test_fused_infer_attention_update_of_sequence_lengths():
    """vllm-ascend's decode graphs: FIA captured once, its actual_seq_lengths_kv changed between
    replays, by a task-group update and by NPUGraph.update (auto_dispatch_capture)."""
    q = torch.randn(1, 4, 1, 8, device="npu", dtype=torch.float16)
    k = torch.randn(1, 4, 16, 8, device="npu", dtype=torch.float16)
    v = torch.randn(1, 4, 16, 8, device="npu", dtype=torch.float16)
    want5, want12 = _fia(q, k, v, [5])[0], _fia(q, k, v, [12])[0]
    assert not torch.equal(want5.cpu(), want12.cpu())

    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out, _ = _fia(q, k, v, [5])
    g.update(cpu_update_input=[{"actual_seq_lengths_kv": [12], "unrelated_key": 1}])
    g.replay()
    assert torch.equal(out.cpu(), want12.cpu())
    with pytest.raises(RuntimeError, match="there are 1 operators .* only 2 elements"):
        g.update(cpu_update_input=[{}, {}])
    plain = torch.npu.NPUGraph()
    with torch.npu.graph(plain):
        _fia(q, k, v, [5])
    with pytest.raises(RuntimeError, match="does not support update"):
        plain.update(cpu_update_input=[{"actual_seq_lengths_kv": [12]}])

    g2 = torch.npu.NPUGraph()
    with torch.npu.graph(g2):
        stream = torch.npu.current_stream()
        torch.npu.graph_task_group_begin(stream)
        out2, _ = _fia(q, k, v, [5])
        handle = torch.npu.graph_task_group_end(stream)
    s = torch.npu.Stream()
    with torch.npu.stream(s):
        torch.npu.graph_task_update_begin(s, handle)
        _fia(q, k, v, [12])
        torch.npu.graph_task_update_end(s)
    assert torch.equal(out2.cpu(), want5.cpu())
    g2.replay()
    assert torch.equal(out2.cpu(), want12.cpu())


def test_debug_dump(tmp_path):
    x = torch.randn(3, device="npu")
    g = torch.npu.NPUGraph()
    g.enable_debug_mode()
    with pytest.warns(UserWarning, match="without a preceding successful capture"):
        g.debug_dump(str(tmp_path / "none.json"))
    assert not (tmp_path / "none.json").exists()
    with torch.npu.graph(g):
        stream = torch.npu.current_stream()
        (x.view(3, 1) * 2).sum()
    path = tmp_path / "graph.json"
    g.debug_dump(str(path))
    events = json.loads(path.read_text())  # a Chrome trace: one "X" span per recorded call
    assert [e["name"] for e in events] == ["aten.view.default", "aten.mul.Tensor",
                                           "aten.sum.default"]
    assert {e["ph"] for e in events} == {"X"}
    assert {e["tid"] for e in events} == {f"stream{stream.stream_id}"}
    assert events[0]["args"]["kind"] == "view" and events[1]["args"]["kind"] == "compute"
    assert events[1]["args"]["outputs"][0]["shape"] == [3, 1]
    assert events[1]["ts"] == events[0]["ts"] + events[0]["dur"]  # capture order
    aligned = json.loads((tmp_path / "graph.aligned.json").read_text())
    assert [e["name"] for e in aligned] == [e["name"] for e in events]
    assert aligned[0]["ts"] == 0.0
    assert aligned[1]["ts"] == pytest.approx(aligned[0]["dur"] + 0.2)


def test_debug_dump_keeps_the_dump_when_alignment_fails(tmp_path, monkeypatch, caplog):
    from opennpu.npu import _npugraph_utils

    def fail(path, output):
        raise RuntimeError("alignment failed")

    monkeypatch.setattr(_npugraph_utils, "align_trace_json", fail)
    x = torch.randn(3, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        x + 1
    assert g.debug_dump(str(tmp_path / "g.json")) is None
    assert json.loads((tmp_path / "g.json").read_text())[0]["name"] == "aten.add.Tensor"
    assert not (tmp_path / "g.aligned.json").exists()
    assert "could not write the aligned trace" in caplog.text


def test_align_trace_json_waits_and_flows(tmp_path):
    from opennpu.npu._npugraph_utils import align_trace_json

    def span(name, tid, ts, dur):
        return {"name": name, "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur}

    # stream2's wait must last until stream1's record has ended
    trace = [span("a", "stream1", 100.0, 5.0), span("EVENT_RECORD_7", "stream1", 400.0, 1.0),
             span("EVENT_WAIT_7", "stream2", 50.0, 1.0), span("b", "stream2", 60.0, 2.0),
             {"name": "meta", "ph": "M", "pid": 0}]
    src = tmp_path / "t.json"
    src.write_text(json.dumps(trace))
    out = align_trace_json(str(src), None)
    assert out == tmp_path / "t.aligned.json"
    assert json.loads(src.read_text()) == trace  # the dump is left alone
    ev = {e["name"]: e for e in json.loads(out.read_text()) if e["ph"] == "X"}
    assert (ev["a"]["ts"], ev["EVENT_RECORD_7"]["ts"]) == (0.0, pytest.approx(5.2))
    record_end = ev["EVENT_RECORD_7"]["ts"] + ev["EVENT_RECORD_7"]["dur"]
    wait = ev["EVENT_WAIT_7"]
    assert wait["ts"] == 0.0 and wait["ts"] + wait["dur"] == pytest.approx(record_end)
    assert ev["b"]["ts"] == pytest.approx(record_end + 0.2)
    flows = [e for e in json.loads(out.read_text()) if e["ph"] in "sf"]
    assert [(f["ph"], f["tid"]) for f in flows] == [("s", "stream1"), ("f", "stream2")]

    src.write_text(json.dumps([span("EVENT_WAIT_2", "stream1", 0, 1),
                               span("EVENT_RECORD_1", "stream1", 1, 1),
                               span("EVENT_WAIT_1", "stream2", 0, 1),
                               span("EVENT_RECORD_2", "stream2", 1, 1)]))
    with pytest.raises(RuntimeError, match="form a cycle"):
        align_trace_json(str(src), str(tmp_path / "c.json"))
    src.write_text(json.dumps({"nodes": []}))
    with pytest.raises(ValueError, match="is not a Chrome trace"):
        align_trace_json(str(src))


def test_graph_dispatch_mode():
    g1, g2 = torch.npu.NPUGraph(), torch.npu.NPUGraph()
    stream = g1.graph_dispatch_mode.update_stream
    assert stream is g2.graph_dispatch_mode.update_stream  # one for the process
    assert stream.device.type == "npu" and stream.stream_id != 0
    q = torch.randn(1, 4, 1, 8, device="npu", dtype=torch.float16)
    k = torch.randn(1, 4, 16, 8, device="npu", dtype=torch.float16)
    with torch.npu.graph(g1, auto_dispatch_capture=True):
        _fia(q, k, k, [5])
        q * 2
    records = g1.graph_dispatch_mode.graph_dispatch_records
    assert [r.func.overloadpacket.__name__ for r in records] == ["npu_fused_infer_attention_score"]
    assert g2.graph_dispatch_mode.graph_dispatch_records == []


def test_fused_infer_attention_score_out_graph():
    """torch_npu._C._npu_fused_infer_attention_score_out_graph: a task-group update of a captured
    FIA .out in one call."""
    q = torch.randn(1, 4, 1, 8, device="npu", dtype=torch.float16)
    k = torch.randn(1, 4, 16, 8, device="npu", dtype=torch.float16)
    v = torch.randn(1, 4, 16, 8, device="npu", dtype=torch.float16)
    want5, want12 = _fia(q, k, v, [5])[0], _fia(q, k, v, [12])[0]
    out = torch.empty_like(want5)
    lse = torch.empty(1, dtype=torch.float16, device="npu")
    kw = dict(num_heads=4, input_layout="BNSD", scale=0.125)
    g, event = torch.npu.NPUGraph(), torch.npu.ExternalEvent()
    with torch.npu.graph(g):
        stream = torch.npu.current_stream()
        event.wait(stream)
        torch.npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(q, k, v, actual_seq_lengths_kv=[5], **kw,
                                                      out=[out, lse])
        handle = torch.npu.graph_task_group_end(stream)
    s = torch.npu.Stream()
    with torch.npu.stream(s):
        returned = torch_npu._C._npu_fused_infer_attention_score_out_graph(
            s, handle, event, q, k, v, actual_seq_lengths_kv=[12], **kw, out=[out, lse])
    assert returned[0] is out and returned[1] is lse
    assert torch.equal(out.cpu(), want5.cpu())  # not run now
    g.replay()
    assert torch.equal(out.cpu(), want12.cpu())
    with pytest.raises(RuntimeError, match="out must have 2 tensors"):
        torch_npu._C._npu_fused_infer_attention_score_out_graph(s, handle, event, q, k, v,
                                                                out=[out])
    with pytest.raises((RuntimeError, TypeError), match="num_heads"):  # bad argument
        torch_npu._C._npu_fused_infer_attention_score_out_graph(
            s, handle, event, q, k, v, num_heads="four", out=[out, lse])
    # the failed update was closed, the graph left as it was: a new update can begin
    torch_npu._C._npu_fused_infer_attention_score_out_graph(
        s, handle, event, q, k, v, actual_seq_lengths_kv=[5], **kw, out=[out, lse])
    g.replay()
    assert torch.equal(out.cpu(), want5.cpu())


def test_names_are_provided():
    for name in ("NPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing",
                 "make_graphed_callables", "graph_task_group_begin", "graph_task_update_end",
                 "ExternalEvent"):
        assert hasattr(torch.npu, name) and name in torch.npu.__all__
        assert getattr(torch_npu.npu, name) is getattr(torch.npu, name)


def test_launch_host_func_runs_at_capture_and_each_replay():
    calls = []
    x = torch.randn(4, device="npu")
    result = torch.zeros(4, device="npu")

    def host(params):
        calls.append(len(params))
        a, out = params
        out.add_(a)  # npu work of the host function: not recorded in the graph

    s = torch.npu.Stream()
    torch_npu.npu._subscribe_report(s)
    torch_npu.npu._launch_host_func(s, host, [x, result])  # no capture: called at once
    assert calls == [2] and torch.equal(result.cpu(), x.cpu())
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        y = x * 2
        torch_npu.npu._launch_host_func(torch.npu.current_stream(), host, [y, result])
    torch.testing.assert_close(result, x * 3)
    g.replay()
    g.replay()
    assert len(calls) == 4
    torch.testing.assert_close(result, x * 7)
    assert [r.kind for r in g._records] == ["compute", "host"]
    w = torch.ones(2, device="npu", requires_grad=True)
    tracked = []
    g2 = torch.npu.NPUGraph()
    with torch.npu.graph(g2, stream=s):
        x + 1
        torch_npu.npu._launch_host_func(s, lambda _: tracked.append((w * 2).requires_grad), None)
    g2.replay()
    assert tracked == [True, True]  # the host function runs with autograd as in eager code
    torch_npu.npu._unsubscribe_report(s)
    with pytest.raises(TypeError, match="stream must be an npu stream"):
        torch_npu.npu._launch_host_func(None, host, [])
    with pytest.raises(TypeError, match="fn must be callable"):
        torch_npu._C._launch_host_func(s, 3, [])


def test_rng_state_read_and_restored_inside_capture_rewinds_each_replay():
    torch.npu.manual_seed(7)
    pre = torch.rand(4, device="npu")
    first = torch.rand(4, device="npu")
    after = torch.rand(4, device="npu")

    torch.npu.manual_seed(7)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        a = torch.rand(4, device="npu")
        state = torch.npu.get_rng_state()
        b = torch.rand(4, device="npu")
        torch.npu.set_rng_state(state)
        c = torch.rand(4, device="npu")
        torch.npu.manual_seed(7)  # the same seed: allowed
    assert torch.equal(b.cpu(), c.cpu())
    torch.npu.manual_seed(7)
    g.replay()
    assert torch.equal(a.cpu(), pre.cpu()) and torch.equal(b.cpu(), first.cpu())
    assert torch.equal(c.cpu(), first.cpu())
    assert torch.equal(torch.rand(4, device="npu").cpu(), after.cpu())
    torch.npu.manual_seed(8)  # another replay start: the rewind is relative to it
    g.replay()
    assert torch.equal(b.cpu(), c.cpu()) and not torch.equal(b.cpu(), first.cpu())


def test_seed_change_during_capture_raises():
    torch.npu.manual_seed(1)
    other = torch.npu.get_rng_state()
    torch.npu.manual_seed(0)
    for change in (lambda: torch.npu.manual_seed(1), lambda: torch.npu.set_rng_state(other)):
        with pytest.raises(RuntimeError, match="only if new seed is the same"):
            with torch.npu.graph(torch.npu.NPUGraph()):
                change()
    g = torch.npu.NPUGraph()
    gen = torch.Generator(device="npu")
    g.register_generator_state(gen)
    with pytest.raises(TypeError, match="expected an npu torch.Generator"):
        g.register_generator_state(torch.Generator())
