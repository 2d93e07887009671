"""torch.save / torch.load of npu tensors, modules and optimizer state, with every form of
map_location, and checkpoints in torch_npu's formats (location "npu:N", and the pre-2.1
_rebuild_npu_tensor pickles)."""

from __future__ import annotations

import io
import pickle
import warnings
import zipfile
from unittest import mock

import pytest
import torch

import torch_npu  # noqa: F401  (torch_npu.utils.storage for the pre-2.1 checkpoints)


def save(obj, **kwargs) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)
    buffer.seek(0)
    return buffer


def roundtrip(obj, **load_kwargs):
    return torch.load(save(obj), **load_kwargs)


def storage_locations(buffer: io.BytesIO) -> list[str]:
    """The location tags of the storages a zip checkpoint records."""
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    locations = []

    class Reader(pickle.Unpickler):
        def persistent_load(self, pid):
            locations.append(pid[3])
            return torch.UntypedStorage(0)

        def find_class(self, module, name):
            return (lambda *args, **kwargs: None) if module.startswith("torch") else \
                super().find_class(module, name)

    Reader(io.BytesIO(data)).load()
    return locations


def test_npu_tensor_keeps_device_values_and_location_tag():
    x = torch.randn(5, 3).npu(1)
    buffer = save(x)
    assert storage_locations(buffer) == ["npu:1"]
    y = torch.load(buffer)
    assert y.device == torch.device("npu:1")
    assert torch.equal(y.cpu(), x.cpu())


@pytest.mark.parametrize("map_location, expected", [
    ("cpu", "cpu"),
    ("npu", "npu:0"),
    ("npu:1", "npu:1"),
    (torch.device("cpu"), "cpu"),
    (torch.device("npu", 1), "npu:1"),
    ({"npu:0": "cpu"}, "cpu"),
    ({"npu:0": "npu:1"}, "npu:1"),
    (lambda storage, location: storage, "cpu"),  # storages arrive on the CPU
    (lambda storage, location: storage.npu(1), "npu:1"),
    (lambda storage, location: None, "npu:0"),  # None: the default restore
])
def test_map_location_from_npu(map_location, expected):
    x = torch.arange(6.0).npu()
    y = roundtrip(x, map_location=map_location)
    assert y.device == torch.device(expected)
    assert torch.equal(y.cpu(), x.cpu())


@pytest.mark.parametrize("map_location, expected", [
    ("npu", "npu:0"), ("npu:1", "npu:1"), (torch.device("npu:1"), "npu:1"),
    ({"cpu": "npu:1"}, "npu:1"), (lambda storage, location: storage.npu(), "npu:0"),
])
def test_map_location_from_cpu(map_location, expected):
    x = torch.arange(6.0)
    y = roundtrip(x, map_location=map_location)
    assert y.device == torch.device(expected)
    assert torch.equal(y.cpu(), x)


def test_map_location_npu_means_the_current_device():
    with torch.npu.device(1):
        assert roundtrip(torch.ones(2), map_location="npu").device == torch.device("npu:1")


def test_views_share_storage_after_load():
    base = torch.arange(12.0).npu()
    saved = {"base": base, "tail": base[4:], "grid": base.view(3, 4).t()}
    for map_location in (None, "cpu", "npu:1"):
        loaded = roundtrip(saved, map_location=map_location)
        assert loaded["tail"].untyped_storage().data_ptr() == \
            loaded["base"].untyped_storage().data_ptr()
        assert loaded["grid"].stride() == (1, 4)
        assert torch.equal(loaded["grid"].cpu(), base.view(3, 4).t().cpu())
        loaded["base"][5] = -1.0  # a write through one is seen by the others
        assert loaded["tail"][1].item() == -1.0
        assert loaded["grid"][1, 1].item() == -1.0


def test_weights_only_load_of_npu_checkpoint():
    x = torch.randn(4, dtype=torch.bfloat16).npu()
    state = {"w": x, "step": 3, "nested": [x[1:]]}
    loaded = roundtrip(state, weights_only=True)
    assert loaded["w"].device == torch.device("npu:0") and loaded["w"].dtype == torch.bfloat16
    assert torch.equal(loaded["nested"][0].cpu(), x[1:].cpu())
    assert loaded["step"] == 3


def test_module_and_optimizer_state_dicts_roundtrip():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).npu()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4).npu()).sum().backward()
    optimizer.step()
    buffer = save({"model": model.state_dict(), "optim": optimizer.state_dict()})

    for map_location, device in ((None, "npu:0"), ("cpu", "cpu"), ("npu:1", "npu:1")):
        buffer.seek(0)
        checkpoint = torch.load(buffer, map_location=map_location, weights_only=True)
        exp_avg = checkpoint["optim"]["state"][0]["exp_avg"]
        assert exp_avg.device == torch.device(device)
        assert torch.equal(exp_avg.cpu(), optimizer.state[model[0].weight]["exp_avg"].cpu())

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    clone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).npu()
    clone.load_state_dict(checkpoint["model"])
    clone_optimizer = torch.optim.AdamW(clone.parameters(), lr=1e-2)
    clone_optimizer.load_state_dict(checkpoint["optim"])
    x = torch.randn(3, 4).npu()
    for m, opt in ((model, optimizer), (clone, clone_optimizer)):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a.cpu(), b.cpu())


def test_whole_module_pickle():
    model = torch.nn.Linear(3, 2).npu(1)
    loaded = roundtrip(model, weights_only=False)
    assert loaded.weight.device == torch.device("npu:1")
    assert isinstance(loaded.weight, torch.nn.Parameter) and loaded.weight.requires_grad
    assert torch.equal(loaded.weight.cpu(), model.weight.cpu())


def test_legacy_tar_format_save():
    x = torch.arange(4.0).npu(1)
    loaded = torch.load(save({"x": x, "v": x[2:]}, _use_new_zipfile_serialization=False))
    assert loaded["x"].device == torch.device("npu:1")
    assert loaded["v"].untyped_storage().data_ptr() == loaded["x"].untyped_storage().data_ptr()
    assert torch.equal(loaded["v"].cpu(), torch.tensor([2.0, 3.0]))


def test_mmap_load(tmp_path):
    path = tmp_path / "ckpt.pt"
    x = torch.randn(8).npu()
    torch.save({"x": x}, path)
    assert torch.equal(torch.load(path, mmap=True)["x"].cpu(), x.cpu())
    assert torch.load(path, mmap=True, map_location="cpu")["x"].device.type == "cpu"


def test_checkpoint_for_a_missing_device_names_the_device():
    with pytest.raises(RuntimeError, match="NPU device 99"):
        roundtrip(torch.ones(2).npu(), map_location="npu:99")


def _old_torch_npu_checkpoint(tensor: torch.Tensor, npu_storage_info=2) -> io.BytesIO:
    """A checkpoint as torch_npu < 2.1 wrote an npu tensor: a call of
    torch_npu.utils.storage._rebuild_npu_tensor over a CPU storage (location "cpu")."""
    rebuild = torch_npu.utils.storage._rebuild_npu_tensor
    cpu = tensor.cpu()

    class OldNpuTensor:
        def __reduce_ex__(self, protocol):
            return rebuild, (cpu.storage(), cpu.storage_offset(), tuple(cpu.size()), cpu.stride(),
                             False, __import__("collections").OrderedDict(), npu_storage_info)

    # The function pickles under the name old checkpoints carry.
    with mock.patch.object(rebuild, "__module__", "torch_npu.utils.storage"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        buffer = save({"w": OldNpuTensor()})
    assert b"torch_npu.utils.storage" in buffer.getvalue()
    return buffer


@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize("map_location, expected", [(None, "cpu"), ("cpu", "cpu"),
                                                    ("npu:1", "npu:1")])
def test_pre_2_1_torch_npu_checkpoint(weights_only, map_location, expected):
    x = torch.randn(2, 3).npu()
    buffer = _old_torch_npu_checkpoint(x)
    loaded = torch.load(buffer, map_location=map_location, weights_only=weights_only)["w"]
    assert loaded.device == torch.device(expected)
    assert torch.equal(loaded.cpu(), x.cpu())


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_saved_npu_tensor_keeps_its_recorded_format(tmp_path, weights_only):
    import torch_npu

    nz = torch_npu.npu_format_cast(torch.randn(4, 32).npu(), 29)
    nchw_as_nd = torch_npu.npu_format_cast(torch.randn(2, 3, 4, 4).npu(), 2)
    plain = torch.randn(2, 3, 4, 4).npu()
    torch.save({"nz": nz, "nd": nchw_as_nd, "plain": plain, "cpu": torch.ones(2)}, tmp_path / "f.pt")
    loaded = torch.load(tmp_path / "f.pt", weights_only=weights_only)
    assert [torch_npu.get_npu_format(loaded[k]) for k in ("nz", "nd", "plain")] == [29, 2, 0]
    assert torch.equal(loaded["nz"].cpu(), nz.cpu()) and loaded["cpu"].device.type == "cpu"
