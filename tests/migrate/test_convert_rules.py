"""Per-rule before/after tables of the offline converter, its analysis rows and its CLI."""

from __future__ import annotations

import pytest

from opennpu.migrate.convert import ConvertOptions, convert_source
from opennpu.migrate.convert import cli, reports, rules
from opennpu.migrate.convert.analysis import resolves

N = "import torch_npu\n"  # what the converter puts before the first torch import

# (id, before, after) with the default options
CASES = [
    ("insert-before-first-torch-import", "import os\nimport torch\n", f"import os\n{N}import torch\n"),
    ("insert-before-from-import", "from torch import nn\n", f"{N}from torch import nn\n"),
    ("insert-keeps-comment-above", "# deps\nimport torch\n", f"# deps\n{N}import torch\n"),
    ("insert-nested-first-import", "def f():\n    import torch.nn\n",
     f"def f():\n    {N}    import torch.nn\n"),
    ("no-torch-no-insert", "import numpy\n", "import numpy\n"),
    ("torch_npu-present", "import torch_npu\nimport torch\n", "import torch_npu\nimport torch\n"),
    ("torch.cuda.X", "import torch\ntorch.cuda.synchronize()\n",
     f"{N}import torch\ntorch.npu.synchronize()\n"),
    ("alias-import-as", "import torch as t\nt.cuda.set_device(0)\n",
     f"{N}import torch as t\nt.npu.set_device(0)\n"),
    ("from-torch-import-cuda", "from torch import cuda\ncuda.synchronize()\n",
     f"{N}from torch import npu as cuda\ncuda.synchronize()\n"),
    ("from-torch-import-cuda-as", "from torch import cuda as c, nn\n",
     f"{N}from torch import npu as c, nn\n"),
    ("from-torch.cuda.amp", "from torch.cuda.amp import GradScaler\nGradScaler()\n",
     f"{N}from torch.npu.amp import GradScaler\nGradScaler()\n"),
    ("import-torch.cuda.amp", "import torch.cuda.amp\ntorch.cuda.amp.autocast()\n",
     f"{N}import torch.npu.amp\ntorch.npu.amp.autocast()\n"),
    ("later-import-torch.cuda-in-scope",
     "def f():\n    import torch\n    a = torch.cuda.x\n    import torch.cuda\n",
     f"def f():\n    {N}    import torch\n    a = torch.npu.x\n    import torch.npu\n"),
    ("module-alias-assignment", "import torch\nCD = torch.cuda\nCD.synchronize()\n",
     f"{N}import torch\nCD = torch.npu\nCD.synchronize()\n"),
    ("local-name-cuda-untouched", "cuda = object()\ncuda.synchronize()\n",
     "cuda = object()\ncuda.synchronize()\n"),
    (".cuda()", "x = y.cuda()\nm.cuda(0)\n", "x = y.npu()\nm.npu(0)\n"),
    ("call-chain-.cuda()", "import torch\nx = torch.zeros(2).cuda()\n",
     f"{N}import torch\nx = torch.zeros(2).npu()\n"),
    ("strict-'cuda'", "d = 'cuda'\ne = \"cuda\"\n", "d = 'npu'\ne = \"npu\"\n"),
    ("strict-only-whole-literal", "s = 'a cuda b'\n", "s = 'a cuda b'\n"),
    ("'cuda:'-substring", "d = 'cuda:1'\nr = r'x cuda:0'\n", "d = 'npu:1'\nr = r'x npu:0'\n"),
    ("f-string-text-part", "d = f'cuda:{rank}'\ne = f\"{a}cuda:{b}\"\n",
     "d = f'npu:{rank}'\ne = f\"{a}npu:{b}\"\n"),
    ("bytes-untouched", "b = b'cuda'\n", "b = b'cuda'\n"),
    ("nccl", "backend = 'nccl'\nB = 'NCCL'\n", "backend = 'hccl'\nB = 'HCCL'\n"),
    ("'torch.cuda'-substring", "name = 'torch.cuda.amp'\n", "name = 'torch.npu.amp'\n"),
    ("comments-untouched", "x = 1  # to('cuda:0') with torch.cuda and 'nccl'\n# .cuda()\n",
     "x = 1  # to('cuda:0') with torch.cuda and 'nccl'\n# .cuda()\n"),
    ("docstring-substring-rules", 'def f():\n    """Runs on cuda:0 via torch.cuda."""\n',
     'def f():\n    """Runs on npu:0 via torch.npu."""\n'),
    ("docstring-no-strict-rule", '"""Needs cuda."""\n', '"""Needs cuda."""\n'),
    ("is_cuda", "ok = x.is_cuda\n", "ok = x.is_npu\n"),
    ("ProfilerActivity.CUDA", "from torch.profiler import ProfilerActivity\na = [ProfilerActivity.CUDA]\n",
     f"{N}from torch.profiler import ProfilerActivity\na = [ProfilerActivity.PrivateUse1]\n"),
    ("ProfilerActivity-qualified", "import torch\na = torch.profiler.ProfilerActivity.CUDA\n",
     f"{N}import torch\na = torch.profiler.ProfilerActivity.PrivateUse1\n"),
    ("other-CUDA-attribute", "a = Backend.CUDA\n", "a = Backend.CUDA\n"),
    ("to(device)-guard", "y = x.to(device)\n",
     "y = x.to(f'npu:{device}' if isinstance(device, int) else device)\n"),
    ("to(attr)-guard", "y = x.to(args.device, non_blocking=True)\n",
     "y = x.to(f'npu:{args.device}' if isinstance(args.device, int) else args.device, non_blocking=True)\n"),
    ("to(int)", "y = x.to(0)\n", "y = x.to('npu:0')\n"),
    ("to(dtype)-whitelisted", "import torch\ny = x.to(torch.float16)\nz = x.to(w.dtype)\n",
     f"{N}import torch\ny = x.to(torch.float16)\nz = x.to(w.dtype)\n"),
    ("to('cpu')", "y = x.to('cpu')\n", "y = x.to('cpu')\n"),
    ("to(call)-not-guarded", "y = x.to(pick())\n", "y = x.to(pick())\n"),
    ("to(x)-inside-f-string", "s = f'{x.to(device)} on cuda:0'\n", "s = f'{x.to(device)} on npu:0'\n"),
    ("to(device=)", "y = x.to(device=dev)\n",
     "y = x.to(device=f'npu:{dev}' if isinstance(dev, int) else dev)\n"),
    ("factory-device=", "import torch\nz = torch.zeros(2, device=dev)\n",
     f"{N}import torch\nz = torch.zeros(2, device=f'npu:{{dev}}' if isinstance(dev, int) else dev)\n"),
    ("factory-device='cuda'", "import torch\nz = torch.ones(2, device='cuda')\n",
     f"{N}import torch\nz = torch.ones(2, device='npu')\n"),
    ("new_zeros-device=", "z = x.new_zeros(2, device=d)\n",
     "z = x.new_zeros(2, device=f'npu:{d}' if isinstance(d, int) else d)\n"),
    ("non-factory-untouched", "import torch\nz = torch.cdist(a, b)\nw = f(device=d)\n",
     f"{N}import torch\nz = torch.cdist(a, b)\nw = f(device=d)\n"),
    ("trailing-comma-kept", "y = f(\n    a,\n    b,\n)\n", "y = f(\n    a,\n    b,\n)\n"),
    ("remove-import-amp_C", "import os\n\nimport amp_C  # kernels\nimport torch\n",
     f"import os\n\n{N}import torch\n"),
    ("remove-import-amp_C-from-list", "import amp_C, math\n", "import math\n"),
    ("remove-import-amp_C-only-statement", "def f():\n    import amp_C\n", "def f():\n    pass\n"),
    ("isinstance-guard", "import torch\nok = isinstance(x, torch.cuda.FloatTensor)\n",
     f"{N}import torch\nok = isinstance(x, torch.npu.FloatTensor)\n"),
    ("is_available-guard",
     "import torch\ndev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n",
     f"{N}import torch\ndev = torch.device('npu' if torch.npu.is_available() else 'cpu')\n"),
]

SPECIFY_DEVICE_HEAD = (
    "\nimport os\nDEVICE_ID = int(os.environ.get('DEVICE_ID', '0'))  # the NPU of this process "
    "(inserted by opennpu.migrate)\nif torch_npu.npu.current_device() != DEVICE_ID:\n"
    "    torch_npu.npu.set_device(f'npu:{DEVICE_ID}')\n")
SPECIFY_DEVICE_CASES = [
    ("to(x)", "import torch\ny = x.to(local_rank)\n",
     f"{N}import torch\n{SPECIFY_DEVICE_HEAD}y = x.to(f'npu:{{DEVICE_ID}}')\n"),
    ("set_device", "import torch\ntorch.cuda.set_device(rank)\n",
     f"{N}import torch\n{SPECIFY_DEVICE_HEAD}torch.npu.set_device(f'npu:{{DEVICE_ID}}')\n"),
    ("torch.device", "import torch\nd = torch.device('cuda', 1)\nc = torch.device('cpu')\n",
     f"{N}import torch\n{SPECIFY_DEVICE_HEAD}d = torch.device(f'npu:{{DEVICE_ID}}')\n"
     "c = torch.device('cpu')\n"),
    (".cuda(x)", "import torch\nm = model.cuda(3)\n", f"{N}import torch\nm = model.npu()\n"),
    ("map_location", "import torch\na = torch.load(p, map_location=loc)\nb = torch.load(p, map_location='cpu')\n",
     f"{N}import torch\n{SPECIFY_DEVICE_HEAD}a = torch.load(p, map_location=f'npu:{{DEVICE_ID}}')\n"
     "b = torch.load(p, map_location='cpu')\n"),
]


@pytest.mark.parametrize("before,after", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule(before, after):
    result = convert_source(before, analyse=False)
    assert result.error is None
    assert result.converted == after
    assert bool(result.changes) == (before != after)


@pytest.mark.parametrize("before,after", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_converted_code_converts_to_itself(before, after):
    again = convert_source(after, analyse=False)
    assert again.converted == after and again.changes == []


@pytest.mark.parametrize("before,after", [c[1:] for c in SPECIFY_DEVICE_CASES],
                         ids=[c[0] for c in SPECIFY_DEVICE_CASES])
def test_specify_device_rule(before, after):
    options = ConvertOptions(specify_device=True)
    assert convert_source(before, options, analyse=False).converted == after
    assert convert_source(after, options, analyse=False).converted == after  # idempotent


def test_specify_device_rules_are_off_by_default():
    assert convert_source("import torch\nd = torch.device('cuda', 1)\n", analyse=False).converted \
        == f"{N}import torch\nd = torch.device('npu', 1)\n"


def test_change_rows_name_lines_types_and_messages():
    result = convert_source("import amp_C\nimport torch\n\nx = torch.ones(1).cuda()\nd = 'nccl'\n",
                            analyse=False)
    assert result.changes == [
        (1, 1, "DELETE", "import amp_C has been removed"),
        (2, 2, "INSERT", "insert import torch_npu"),
        (4, 4, "MODIFY", "change function cuda to npu"),
        (5, 5, "MODIFY", 'replace string "nccl" with "hccl"'),
    ]


def test_unparsable_file_is_reported_and_left_alone():
    result = convert_source("def f(:\n    x.cuda()\n")
    assert result.error and "skipped" in result.error
    assert not result.changed


def test_converted_guards_run_on_the_npu_device():
    """isinstance / is_available guards and the int-device guard are right at run time."""
    source = ("import torch\n"
              "assert torch.cuda.is_available()\n"
              "x = torch.ones(2).cuda()\n"
              "assert x.is_cuda and isinstance(x, torch.cuda.FloatTensor)\n"
              "dev = 0\n"
              "y = torch.zeros(2, device=dev)\n"
              "z = x.to(dev)\n"
              "w = x.to(torch.device('cuda:0'))\n")
    converted = convert_source(source, analyse=False).converted
    scope: dict = {}
    exec(compile(converted, "<converted>", "exec"), scope)  # noqa: S102 - our own test snippet
    assert {scope[k].device.type for k in "xyzw"} == {"npu"}


# -- analysis rows -------------------------------------------------------------------------------

def test_unsupported_apis_through_aliases_and_nccl_comparisons():
    result = convert_source(
        "import torch\nfrom torch.nn import DataParallel as DP\nimport torch.distributed as dist\n"
        "m = DP(net)\ncap = torch.cuda.get_device_capability()\n"
        "if dist.get_backend() != 'nccl':\n    pass\nif b in ('gloo', 'nccl'):\n    pass\n"
        "x = torch.channels_last\n")
    ops = [(row[0], row[2]) for row in result.unsupported]
    assert ops == [(4, "torch.nn.DataParallel"), (5, "torch.cuda.get_device_capability"),
                   (6, "dist.get_backend() != 'nccl'"), (8, "b in ('gloo', 'nccl')"),
                   (10, "torch.channels_last")]
    assert "DistributedDataParallel" in result.unsupported[0][3]


def test_unknown_apis_are_torch_names_that_do_not_resolve():
    result = convert_source("import torch\nimport torch.nn.functional as F\n"
                            "a = F.relu(x)\nb = torch.nn.functonal.relu(x)\nc = torch.not_an_api\n"
                            "d = torch.zeros(2).cuda()\ne = torch.utils.checkpoint.checkpoint\n"
                            "layer = torch.nn.Linear\nw = layer.weight\n")
    assert [(row[0], row[2]) for row in result.unknown] == [
        (4, "torch.nn.functonal.relu"), (5, "torch.not_an_api")]
    assert resolves("torch.ops.aten.add") and resolves("torch.utils.cpp_extension.load")
    assert resolves("torch.nn.functonal") is False


PERF_CASES = [
    ("import torch\nopt = torch.optim.AdamW(p)\n", "optim.fused", "torch.optim.AdamW"),
    ("from torch.optim import SGD\nopt = SGD(p, lr=1)\n", "optim.fused", "torch.optim.SGD"),
    ("import torch\ntorch.nn.utils.clip_grad_norm_(p, 1.0)\n", "optim.clip_grad_norm_fused",
     "torch.nn.utils.clip_grad_norm_"),
    ("import torch.nn.functional as F\no = F.scaled_dot_product_attention(q, k, v)\n",
     "attention.fusion", "torch.nn.functional.scaled_dot_product_attention"),
    ("class Norm(nn.Module):\n    def forward(self, x):\n"
     "        return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))\n",
     "norm.rms_norm", "class Norm"),
    ("def rot(x):\n    a, b = x.chunk(2, -1)\n    return torch.cat((-b, a), dim=-1)\n",
     "rotary.rotary_mul", "def rot"),
    ("y = F.silu(a) * b\n", "activation.swiglu", "F.silu(a) * b"),
    ("def attn(q, k, v):\n    return (q @ k.transpose(-1, -2)).softmax(-1) @ v\n",
     "attention.fusion", "def attn"),
]


@pytest.mark.parametrize("source,rule,op", PERF_CASES, ids=[c[1] + ":" + c[2] for c in PERF_CASES])
def test_performance_advice(source, rule, op):
    rows = convert_source(source).performance
    assert [(r[2], r[3].split("]")[0] + "]") for r in rows] == [(op, f"[{rule}]")]


def test_layer_norm_is_not_advised_as_rms_norm():
    source = ("class LN(nn.Module):\n    def forward(self, x):\n"
              "        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)\n")
    assert convert_source(source).performance == []


def test_cuda_op_scan():
    cpp = ('// PYBIND11_MODULE(fake, m) { m.def("no", &f); }\n'
           "PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {\n"
           '  mod.def("fwd", &fwd, py::arg("x"));\n  /* mod.def("commented", &c); */\n}\n'
           'TORCH_LIBRARY_FRAGMENT(ns, m) {\n  m.def("op.overload(Tensor x) -> Tensor");\n}\n')
    assert reports.scan_cuda_ops(cpp) == ["fwd", "ns::op"]


def test_rule_file_errors_name_the_rule(tmp_path, monkeypatch):
    (tmp_path / "bad.json").write_text(
        '{"device_arg_whitelist": "x", "ReplaceString": [{"name": "r", "old": "a", "new": "b", '
        '"strict": true, "feature_switch": ["normal"], "colour": 1}]}')
    monkeypatch.setattr(rules, "RULES_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"bad.json: ReplaceString rule 'r' has unknown keys \['colour'\]"):
        rules.load_rules(frozenset({"normal"}), "bad.json")


# -- command line ------------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path):
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("import torch\nx = torch.ones(1).cuda()\n")
    (root / "pkg" / "clean.py").write_text("print('hello')\n")
    return root


def test_check_exit_codes(project, capsys):
    assert cli.main(["-i", str(project), "--check"]) == 1
    err = capsys.readouterr().err
    assert "would convert train.py" in err and "1 of 2 Python files" in err
    assert cli.main(["-i", str(project / "pkg"), "--check"]) == 0


def test_diff_prints_and_writes_nothing(project, tmp_path, capsys):
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert cli.main(["-i", str(project), "--diff"]) == 0
    out = capsys.readouterr().out
    assert "--- a/train.py\n+++ b/train.py\n" in out
    assert "-x = torch.ones(1).cuda()\n+x = torch.ones(1).npu()\n" in out and "+import torch_npu\n" in out
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert (project / "train.py").read_text() == "import torch\nx = torch.ones(1).cuda()\n"


def test_project_result_layout_and_force(project, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert cli.main(["-i", str(project), "-o", str(out)]) == 0
    result = out / "proj_msft"
    assert (result / "train.py").read_text() == f"{N}import torch\nx = torch.ones(1).npu()\n"
    assert (result / "pkg" / "clean.py").read_text() == "print('hello')\n"
    log = (result / "transplant_result_file" / "msFmkTranspltlog.txt").read_text()
    assert "PyTorch version 2.8.0" in log
    assert "change_list.csv" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["-i", str(project), "-o", str(out)])
    assert exc.value.code == 2
    assert "-o/--output" in capsys.readouterr().err
    assert cli.main(["-i", str(project), "-o", str(out), "--force", "-v", "2.1.0"]) == 0
    assert "PyTorch version 2.1.0" in (result / "transplant_result_file" / "msFmkTranspltlog.txt").read_text()


def test_single_file_input(project, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert cli.main(["-i", str(project / "train.py"), "-o", str(out)]) == 0
    assert (out / "train_msft" / "train.py").read_text().startswith(N)
    assert (out / "train_msft" / "transplant_result_file" / "change_list.csv").is_file()


def test_in_place(project):
    assert cli.main(["-i", str(project), "--in-place"]) == 0
    assert (project / "train.py").read_text() == f"{N}import torch\nx = torch.ones(1).npu()\n"
    assert cli.main(["-i", str(project), "--check"]) == 0


def test_opennpu_migrate_subcommand(project, capsys):
    from opennpu.__main__ import main
    assert main(["migrate", "-i", str(project), "--check"]) == 1


@pytest.mark.parametrize("args,expected", [
    (["-i", "{missing}", "-o", "{out}"], "-i/--input: expected an existing project directory or .py file, got"),
    (["-i", "{proj}", "-o", "{missing}"], "-o/--output: expected an existing directory, got"),
    (["-i", "{proj}", "-o", "{proj}/pkg"], "-o/--output: expected a directory outside the -i/--input project"),
    (["-i", "{proj}"], "-o/--output: expected an existing output directory (required unless"),
    (["-i", "{proj}/notes.txt", "-o", "{out}"], "-i/--input: expected a project directory or a .py file"),
    (["-i", "{proj}", "-o", "{out}", "distributed", "-m", "nope.py"],
     "distributed -m/--main: expected a .py file of the -i/--input project, got 'nope.py'"),
    (["-i", "{proj}", "-o", "{out}", "-v", "1.5.0"], "argument -v/--version: invalid choice: '1.5.0'"),
])
def test_bad_arguments_name_the_option(project, tmp_path, capsys, args, expected):
    (project / "notes.txt").write_text("x")
    out = tmp_path / "out"
    out.mkdir()
    paths = {"missing": str(tmp_path / "missing"), "out": str(out), "proj": str(project)}
    with pytest.raises(SystemExit) as exc:
        cli.main([a.format(**paths) for a in args])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err
