"""Registration of the npu device: names, modules, generated methods, autoload."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import opennpu


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_privateuse1_is_named_npu():
    assert torch._C._get_privateuse1_backend_name() == "npu"
    assert torch.device("npu:1").type == "npu"


def test_torch_npu_and_torch_npu_module_are_one_object():
    import torch_npu
    import torch_npu.npu
    import torch_npu.npu.amp
    import torch_npu.npu.utils

    assert torch_npu.npu.utils.get_device_name is torch.npu.get_device_name
    assert torch.npu is opennpu.npu
    assert torch_npu.npu is torch.npu
    assert sys.modules["torch.npu"] is torch.npu
    assert torch_npu.npu.amp is torch.npu.amp
    assert torch_npu.npu.amp.GradScaler is torch.npu.amp.GradScaler


def test_generated_methods():
    x = torch.ones(2)
    y = x.npu()
    assert y.is_npu and not x.is_npu
    assert y.device == torch.device("npu:0")
    assert torch.nn.Linear(2, 2).npu().weight.device.type == "npu"
    assert y.untyped_storage().is_npu
    assert y.untyped_storage().device.type == "npu"
    assert x.untyped_storage().npu().device.type == "npu"


def test_bare_integer_device_means_npu():
    assert torch.device(0).type == "npu"
    assert torch.ones(2, device=0).device == torch.device("npu:0")


def test_accelerator_reports_npu():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("npu")
    assert torch.accelerator.device_count() == torch.npu.device_count()


def test_import_torch_alone_brings_the_device():
    result = run_python("import torch; print(torch.ones(1, device='npu').device, torch.npu.is_available())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["npu:0", "True"]


def test_autoload_stays_light_and_lazy_modules_load_on_use():
    """torch._dynamo (seconds to import) is left to the modules that need it: opennpu.optim and
    torch.npu.amp load on first use."""
    result = run_python("import sys, torch, opennpu; print('torch._dynamo' in sys.modules); "
                        "print(opennpu.optim.NpuFusedAdamW.__name__, torch.npu.amp.GradScaler.__name__)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "NpuFusedAdamW", "GradScaler"]


def test_autoload_can_be_turned_off():
    result = run_python("import torch; print(hasattr(torch, 'npu'), torch._C._get_privateuse1_backend_name())",
                        TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "privateuseone"]
    result = run_python("import torch, torch_npu; print(torch.npu.device_count())",
                        TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "8"


def test_legacy_tensor_types():
    x = torch.npu.FloatTensor(2, 3)
    assert x.shape == (2, 3) and x.dtype == torch.float32 and x.device.type == "npu"
    assert isinstance(x, torch.npu.FloatTensor) and not isinstance(x, torch.npu.HalfTensor)
    assert not isinstance(torch.zeros(2), torch.npu.FloatTensor)
    y = torch.npu.LongTensor([1, 2], device="npu:1")
    assert y.dtype == torch.int64 and y.device == torch.device("npu:1") and y.tolist() == [1, 2]
    assert torch.npu.HalfTensor(torch.ones(2)).dtype == torch.float16
    assert torch.npu.BoolTensor(torch.Size([3])).shape == (3,)
    # Tensor.type with the classes, as with torch.cuda's
    z = torch.arange(3).type(torch.npu.FloatTensor)
    assert z.device.type == "npu" and z.dtype == torch.float32 and z.type() == "torch.npu.FloatTensor"
    assert z.type(torch.npu.HalfTensor).dtype == torch.float16
    assert repr(torch.npu.FloatTensor) == "<class 'torch.npu.FloatTensor'>"


def test_data_swaps_between_cpu_and_npu():
    """`param.data = param.data.npu()` (older training scripts move parameters this way)."""
    p = torch.nn.Parameter(torch.arange(4.0))
    p.data = p.data.npu()
    assert p.device.type == "npu" and isinstance(p, torch.nn.Parameter) and p.requires_grad
    p.sum().backward()
    assert p.grad.device.type == "npu" and p.grad.tolist() == [1.0] * 4
    p.data = p.data.cpu()
    assert p.device.type == "cpu" and p.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        p.data = torch.zeros(4).to_sparse()


SEED_001_SCRIPT = """
import torch
import torch_npu
from torch import nn

device = torch.device("npu:0")
torch.npu.set_device(device)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.CrossEntropyLoss().npu()
x = torch.randn(32, 8).npu()
y = (x[:, 0] > 0).long().to(device)
losses = []
for _ in range(20):
    loss = loss_fn(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
torch.npu.synchronize()
assert next(model.parameters()).device == device
print(torch.npu.device_count(), torch.npu.memory_allocated() > 0, losses[-1] < losses[0])
"""


def test_seed_001_manual_migration_runs():
    """Seed 001's manual migration (without AMP, not provided yet): import torch_npu, npu:0,
    set_device, .to(device) / .npu(), synchronize."""
    result = run_python(SEED_001_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["8", "True", "True"]


# One accelerator per process (_opennpu_compat.npu_device_wanted): npu, and torch_npu, stay off
# beside a visible CUDA GPU unless OPENNPU_NPU_DEVICE=1, since a registered npu breaks every CUDA
# backward in the process (pytorch#161129).

def test_npu_is_off_beside_a_visible_gpu_unless_asked_for(monkeypatch):
    import _opennpu_compat as compat

    monkeypatch.delenv(compat.NPU_DEVICE_ENV, raising=False)
    monkeypatch.setattr(compat, "cuda_gpu_visible", lambda: True)
    assert not compat.npu_device_wanted()  # import torch / import opennpu / a probe for torch_npu
    assert compat.CompatFinder().find_spec("torch_npu") is None
    assert compat.npu_device_wanted(explicit=True)  # opennpu.compat.torch_npu imported by name
    monkeypatch.setattr(compat, "cuda_gpu_visible", lambda: False)
    assert compat.npu_device_wanted()
    assert compat.CompatFinder().find_spec("torch_npu") is not None
    monkeypatch.setenv(compat.NPU_DEVICE_ENV, "0")
    assert not compat.npu_device_wanted(explicit=True)
    monkeypatch.setenv(compat.NPU_DEVICE_ENV, "1")
    monkeypatch.setattr(compat, "cuda_gpu_visible", lambda: True)
    assert compat.npu_device_wanted()
    assert compat.CompatFinder().find_spec("torch_npu") is not None
    monkeypatch.setenv(compat.NPU_DEVICE_ENV, "yes")
    with pytest.raises(ValueError, match="OPENNPU_NPU_DEVICE must be 0, 1 or auto, but got 'yes'"):
        compat.npu_device_wanted()


def test_npu_device_off_keeps_the_accelerator_and_the_ops():
    code = ("import torch, opennpu\n"
            "assert not hasattr(torch, 'npu'), 'npu registered'\n"
            "assert torch._C._get_privateuse1_backend_name() == 'privateuseone'\n"
            "acc = torch.accelerator.current_accelerator()\n"
            "assert acc is None or acc.type != 'npu', acc\n"
            "x = torch.randn(3, 8, requires_grad=True)\n"
            "torch.ops.npu.npu_rms_norm(x, torch.ones(8))[0].sum().backward()\n"
            "try:\n"
            "    import torch_npu\n"
            "except ModuleNotFoundError:\n"
            "    print('ok')\n")
    result = run_python(code, OPENNPU_NPU_DEVICE="0", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_beside_a_gpu_torch_npu_needs_the_switch_which_warns_about_cuda_autograd():
    probe = run_python("import torch, opennpu\n"
                       "try:\n    import torch_npu\nexcept ModuleNotFoundError:\n    print('absent')\n"
                       "print(torch.accelerator.current_accelerator().type)",
                       TORCH_DEVICE_BACKEND_AUTOLOAD="0", OPENNPU_NPU_DEVICE="auto")
    assert probe.returncode == 0 and probe.stdout.split() == ["absent", "cuda"], probe.stderr
    result = run_python("import warnings; warnings.simplefilter('always'); import torch_npu; "
                        "import torch; print(torch.accelerator.current_accelerator())",
                        TORCH_DEVICE_BACKEND_AUTOLOAD="0", OPENNPU_NPU_DEVICE="1")
    assert result.returncode == 0, result.stderr
    assert "npu" in result.stdout and "pytorch/pytorch#161129" in result.stderr


def test_analyze_turns_npu_on_beside_a_gpu(tmp_path):
    # `opennpu analyze` runs a script on npu: beside a (here simulated) GPU it asks for the device
    script = tmp_path / "train.py"
    script.write_text("import torch, torch_npu\nprint(float((torch.ones(2).npu() * 3).sum()))\n")
    code = ("import _opennpu_compat\n"
            "_opennpu_compat.cuda_gpu_visible = lambda: True  # as beside a GPU\n"
            "import torch, opennpu\n"
            "assert not hasattr(torch, 'npu')\n"
            "from opennpu.analyze import runner\n"
            f"assert runner.main([{str(script)!r}, '-o', {str(tmp_path / 'report')!r}]) == 0\n"
            "assert torch.npu.is_available()\n")
    # auto: a test before this one in the worker may have run `analyze` in-process (which sets 1)
    result = run_python(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OPENNPU_NPU_DEVICE="auto")
    assert result.returncode == 0, result.stderr
    assert "6.0" in result.stdout and "pytorch/pytorch#161129" in result.stderr
