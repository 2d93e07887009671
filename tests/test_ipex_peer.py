"""The IPEX peer of the benchmark harness (benchmarks/ipex_peer.py, benchmarks/ipex_worker.py)
without IPEX: the pipe protocol against a fake worker, the skip paths, the error measure. Nothing
here asserts a timing."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# A worker with IPEX's calls replaced: rms_norm as an fp32 composition, nothing else (a skip).
# It prints on stdout, as libraries do, which must not reach the protocol stream.
FAKE_WORKER = f"""
import sys
import torch
sys.path.insert(0, {str(ROOT)!r})
from benchmarks import ipex_worker as w

def build(case, shape, inputs):
    if case != "rms_norm":
        raise NotImplementedError("the fake has rms_norm only")
    x, weight = inputs
    def fn():
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + w.EPS) * weight.float()
        return y.to(x.dtype)
    print("library chatter on stdout")
    return fn, fn

sys.exit(w.main(build, lambda: "fake"))
"""


@pytest.fixture
def peer(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # benchmarks/ is part of the checkout, not the wheel
    from benchmarks import ipex_peer

    return ipex_peer


@pytest.fixture
def fake(peer, tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    worker = peer.IpexWorker(sys.executable, [str(script), peer.timing.__file__])
    yield worker
    worker.close()


def test_fake_worker_round_trip(peer, fake):
    assert fake.versions == f"torch {torch.__version__}, IPEX fake"
    case = peer.IpexCase("rms_norm", {"T": 16, "H": 64}, ("fp32", "bf16"))
    for dtype in ("fp32", "bf16"):
        row = peer.run_case(fake, case, dtype, threads=1, repeats=3, min_run_time=0.0)
        assert row["ours"] > 0 and row["ipex"] > 0
        assert row["ratio"] == pytest.approx(row["ipex"] / row["ours"])
        # both compute in fp32: within a few fp32 roundings of the floor, and bf16's is one
        for side in ("ours", "ipex"):
            assert 0 < row[f"err_{side}"] and row[f"floor_{side}"] <= 16, (dtype, row)
            assert dtype == "fp32" or row[f"floor_{side}"] <= 1.5, (dtype, row)
    assert "x IPEX" in peer.HEADER and "skipped" not in peer.format_row(row)


def test_fake_worker_skips_what_it_lacks_and_reports_errors(peer, fake):
    case = peer.IpexCase("rotary_mul", {"S": 4, "N": 2, "D": 8}, ("fp32",))
    row = peer.run_case(fake, case, "fp32", threads=1, repeats=1, min_run_time=0.0)
    assert row["skip"] == "NotImplementedError: the fake has rms_norm only"
    assert "IPEX skipped: NotImplementedError" in peer.format_row(row)
    # the skipped case left nothing to time: an error reply, and the worker serves on
    with pytest.raises(RuntimeError, match="IPEX worker: RuntimeError: no case is set up"):
        fake.request(cmd="time", min_run_time=0.0)
    with pytest.raises(RuntimeError, match="unknown command 'nap'"):
        fake.request(cmd="nap")
    assert fake.proc.poll() is None


def test_inputs_are_the_same_in_both_processes(peer, fake, tmp_path):
    # the worker's checksum of its inputs is compared with ours; a different seed would differ
    reply = fake.request(cmd="setup", case="rms_norm", shape={"T": 8, "H": 32}, dtype="bf16",
                         seed=3, threads=1, out=str(tmp_path / "out.pt"))
    inputs = peer.make_inputs("rms_norm", {"T": 8, "H": 32}, torch.bfloat16, 3)
    assert reply["checksum"] == peer.checksum(inputs)
    assert reply["checksum"] != peer.checksum(
        peer.make_inputs("rms_norm", {"T": 8, "H": 32}, torch.bfloat16, 4))


def test_without_ipex_python_the_table_is_skipped_with_a_note(peer):
    rows, notes = peer.run_table(None, ["rms_norm"], ["fp32"], [1])
    assert rows == [] and notes == [
        "IPEX column skipped: no --ipex-python or OPENNPU_IPEX_PYTHON names a Python with "
        "torch 2.8 + intel_extension_for_pytorch"]


def test_a_python_without_ipex_is_skipped_with_its_import_error(peer):
    pytest.importorskip("torch")  # this Python: opennpu's, without IPEX
    try:
        import intel_extension_for_pytorch  # noqa: F401
        pytest.skip("this Python has IPEX")
    except ImportError:
        pass
    rows, notes = peer.run_table(sys.executable, ["rms_norm"], ["fp32"], [1])
    assert rows == [] and len(notes) == 1
    assert notes[0].startswith(f"IPEX column skipped: {sys.executable}: import "
                               "intel_extension_for_pytorch: ModuleNotFoundError")


def test_a_missing_python_is_skipped(peer, tmp_path):
    rows, notes = peer.run_table(str(tmp_path / "no-python"), ["rms_norm"], ["fp32"], [1])
    assert rows == [] and notes[0].startswith("IPEX column skipped:")


def test_run_takes_the_ipex_python_from_flag_or_environment(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import run

    monkeypatch.setenv("OPENNPU_IPEX_PYTHON", "/env/python")
    assert run.parse_args([]).ipex_python == "/env/python"
    assert run.parse_args(["--ipex-python", "/flag/python"]).ipex_python == "/flag/python"
    monkeypatch.delenv("OPENNPU_IPEX_PYTHON")
    assert run.parse_args([]).ipex_python is None


def test_errors_are_measured_against_the_rounding_floor(peer):
    ref = torch.tensor([1.0 + 2.0 ** -10, 3.0], dtype=torch.float64)  # bf16 rounds 1 + 2^-10
    floor = 2.0 ** -10
    err, over = peer.errors(ref.to(torch.bfloat16), ref, torch.bfloat16)
    assert err == floor and over == 1.0
    err, over = peer.errors(ref.to(torch.bfloat16) + torch.tensor([0.0, 2.0 ** -7]), ref,
                            torch.bfloat16)
    assert err == 2.0 ** -7 and over == 8.0
    assert math.isnan(peer.errors(ref, ref, torch.float64)[1])  # no rounding: no floor


def test_llama_layer_inputs_load_into_transformers_layer(peer):
    """The llama_layer case's weights (make_inputs) are exactly a LlamaDecoderLayer's parameters
    (strict load), and the float64 layer built from them gives finite, non-trivial outputs."""
    pytest.importorskip("transformers")
    shape = {"S": 8, "H": 32, "N": 4, "Nkv": 2, "I": 48}
    inputs = peer.make_inputs("llama_layer", shape, torch.float32, seed=0)
    names = [name for name, _ in peer.llama_weight_shapes(shape)]
    layer, rotary = peer._llama_layer(shape, inputs[1:], torch.float64)
    assert set(names) == set(layer.state_dict())
    x = inputs[0].double()
    cos, sin = rotary(x, torch.arange(shape["S"])[None])
    out = peer._LlamaCall(layer)(x, cos, sin)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, x)  # the layer did something to the residual stream
