"""Registration of the npu device: names, modules, generated methods, autoload."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_autoload_can_be_turned_off():
    result = run_python("import torch; print(hasattr(torch, 'npu'), torch._C._get_privateuse1_backend_name())",
                        TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "privateuseone"]
    result = run_python("import torch, torch_npu; print(torch.npu.device_count())",
                        TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "8"
