"""Classification of one operator: how opennpu's npu device runs it, and whether Ascend has it.

How our npu device runs an op (column `npu`), read from the dispatcher's computed table for the
PrivateUse1 key (`torch._C._dispatch_dump_table`), which names the kind of entry and where it was
registered:

- ``npu-kernel``: a kernel registered for PrivateUse1 by opennpu's device layer itself (tensor
  creation and views, copies, the unboxed arithmetic ops, the fused RNN cells);
- ``fallback``: the boxed zero-copy fallback (csrc/device/npu_fallback.cpp) runs the op's CPU
  kernel on CPU aliases of the npu tensors. Either the global PrivateUse1 fallback catches it, or
  the fallback is registered as the op's own npu kernel ("routed": the op has a CPU kernel and a
  composite, and npu must take CPU's kernel). torch.ops.npu ops reach their C++ CPU kernels this
  way;
- ``composite``: PyTorch's CompositeExplicitAutograd kernel runs for npu (aten::t, clone,
  _to_copy, expand ...); the ops it calls dispatch to npu in turn;
- ``composite-implicit``: a CompositeImplicitAutograd op (it decomposes above autograd, so a
  dispatch mode normally never sees it);
- ``missing``: nothing can run it on npu (the fallback finds no CPU kernel): it raises.

Whether Ascend's torch_npu has it (column `ascend`), from data/ascend_ops_<version>.json (derived
from op-plugin's op_plugin_functions.yaml and torch_npu's npu_native_functions.yaml by
scripts/update_ascend_op_list.py):

- ``op-plugin``: op-plugin builds an NPU kernel (aclnn op_api or ACL acl_op) for it, for the
  listed PyTorch version;
- ``torch_npu``: torch_npu implements it in its own framework layer (empty, view, copy_ ...);
- ``composite``: listed in neither, but PyTorch has a composite kernel for it, which torch_npu
  runs as every backend does (its constituent ops need support in turn);
- ``cpu-fallback``: listed in neither and not composite: torch_npu's PrivateUse1 fallback copies
  the tensors to the host, runs the CPU kernel and warns ("will fall back to run on the CPU"),
  or raises where CPU fallback is disallowed;
- ``via-parent``: the op does not occur on Ascend: opennpu's device reaches it only inside a
  composite op that Ascend implements itself, so there the composite never decomposes into it.
  Either the census saw it only as an inner call of composites (copy_ -> _copy_from), each with
  an op-plugin / torch_npu ancestor, or it is a known CompositeImplicitAutograd case (PARENTS;
  SDPA: opennpu picks CPU's flash kernel, Ascend runs aten::scaled_dot_product_attention as
  npu_fusion_attention), checked against the data;
- ``not-in-op-plugin``: an npu:: op that op-plugin does not list (an opennpu op Ascend lacks, or
  a newer one than the data);
- ``opennpu-only``: opennpu's own helper ops (namespace opennpu), never on Ascend.

One headline `status` per op combines them:

- ``fused``: a torch.ops.npu / opennpu fused kernel;
- ``native``: an ATen op Ascend has a kernel for (op-plugin or torch_npu);
- ``composite``: an ATen op that decomposes (on Ascend as here);
- ``ascend-cpu-fallback``: an ATen op Ascend runs on the host (flagged: a migration risk);
- ``missing``: cannot run on opennpu's npu device.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import torch

DATA_DIR = Path(__file__).parent / "data"
_TABLE_LINE = re.compile(r"^PrivateUse1: (?:fallthrough )?registered at "
                         r"(?P<where>.*?):(?P<line>\d+) \[(?P<kind>[^\]]+)\]")
_FALLBACK_FILE = "npu_fallback.cpp"

# Ops our npu device reaches only through a CompositeImplicitAutograd parent that op-plugin
# implements for NPU itself (so on Ascend the parent never decomposes into them).
PARENTS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward":
        "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_attention_math": "aten::scaled_dot_product_attention",
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the report (the CSV's columns, in order)."""

    op: str
    status: str
    npu: str
    ascend: str
    calls: int
    inner: int
    forward: int
    backward: int
    optimizer: int
    other: int
    modules: str
    dtypes: str
    devices: str
    signatures: str
    npu_detail: str
    note: str = ""

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


# -- the npu device ----------------------------------------------------------------------------


def _has(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=None)
def npu_dispatch(op: str) -> tuple[str, str]:
    """(kind, detail) of how the npu device runs `op` (a dispatcher name, `aten::add.Tensor`)."""
    try:
        table = torch._C._dispatch_dump_table(op)
    except RuntimeError:
        return "missing", "not a registered operator"
    entry = next((m for m in map(_TABLE_LINE.match, table.splitlines()) if m), None)
    has_cpu = _has(op, "CPU")
    if entry is None:  # a table this parser does not understand: the dispatcher's yes/no queries
        if _has(op, "PrivateUse1"):
            return "npu-kernel", "a PrivateUse1 registration (source unknown)"
        if _has(op, "CompositeExplicitAutograd"):
            return "composite", "CompositeExplicitAutograd kernel: its ops dispatch to npu"
        if _has(op, "CompositeImplicitAutograd"):
            return "composite-implicit", "CompositeImplicitAutograd: decomposes above autograd"
        if has_cpu:
            return "fallback", "the CPU kernel, through a PrivateUse1 fallback"
        return "missing", "no PrivateUse1 entry in the dispatch table and no CPU kernel"
    where, kind = Path(entry.group("where")).name, entry.group("kind")
    source = f"{where}:{entry.group('line')}"
    if kind == "backend fallback":
        if where != _FALLBACK_FILE:
            return "fallback", f"another backend fallback ({source})"
        if not has_cpu:
            return "missing", "the zero-copy fallback finds no CPU kernel"
        return "fallback", "zero-copy fallback: the CPU kernel on the npu memory"
    if kind == "kernel":
        if where == _FALLBACK_FILE:
            return "fallback", ("zero-copy fallback, routed per op over the composite: "
                                "the CPU kernel")
        return "npu-kernel", f"PrivateUse1 kernel ({source})"
    if kind == "default backend kernel":
        return "composite", "CompositeExplicitAutograd kernel: its ops dispatch to npu"
    if kind == "math kernel":
        return "composite-implicit", "CompositeImplicitAutograd: decomposes above autograd"
    return kind, source


# -- Ascend ------------------------------------------------------------------------------------


def available_versions() -> list[str]:
    return sorted(p.stem.removeprefix("ascend_ops_") for p in DATA_DIR.glob("ascend_ops_*.json"))


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.\-]", version))


def default_version() -> str:
    """The data for the installed torch's minor version, else the newest shipped."""
    versions = available_versions()
    if not versions:
        raise FileNotFoundError(f"opennpu.analyze: no ascend_ops_*.json in {DATA_DIR}")
    mine = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return mine if mine in versions else max(versions, key=_version_key)


@functools.lru_cache(maxsize=None)
def ascend_data(version: str | None = None) -> dict:
    """The shipped Ascend op list: {"op_plugin": {"aten": [...], "npu": [...]}, "torch_npu":
    {...}, "sources": {...}, "torch_version", "date"}; names are sets here."""
    version = version or default_version()
    data = json.loads((DATA_DIR / f"ascend_ops_{version}.json").read_text())
    for key in ("op_plugin", "torch_npu"):
        data[key] = {ns: frozenset(names) for ns, names in data.get(key, {}).items()}
    data["version"] = version
    return data


def ascend_support(op: str, version: str | None = None) -> str:
    """How Ascend's torch_npu runs `op` (see the module docstring)."""
    namespace, _, name = op.partition("::")
    if namespace == "opennpu":
        return "opennpu-only"
    data = ascend_data(version)
    if name in data["op_plugin"].get(namespace, ()):
        return "op-plugin"
    if name in data.get("torch_npu", {}).get(namespace, ()):
        return "torch_npu"
    parent = PARENTS.get(op)
    if parent is not None and parent.partition("::")[2] in data["op_plugin"].get("aten", ()):
        return "via-parent"
    if namespace != "aten":
        return "not-in-op-plugin"
    if _has(op, "CompositeExplicitAutograd") or _has(op, "CompositeImplicitAutograd") \
            or _has(op, "CompositeExplicitAutogradNonFunctional"):
        return "composite"
    return "cpu-fallback"


# -- the row -----------------------------------------------------------------------------------


def status_of(op: str, npu: str, ascend: str) -> str:
    namespace = op.partition("::")[0]
    if npu == "missing":
        return "missing"
    if namespace in ("npu", "opennpu"):
        return "fused"
    if ascend in ASCEND_HAS:
        return "native"
    if ascend == "composite":
        return "composite"
    return "ascend-cpu-fallback"


def format_signatures(record, top: int) -> str:
    return " | ".join(f"{count}x: {sig}" for count, sig in record.top_signatures(top))


ASCEND_HAS = ("op-plugin", "torch_npu", "via-parent")


def _inside_ascend_op(record, version) -> str | None:
    """For an op seen only inside composites: the composites Ascend implements itself around
    every one of its calls (joined), or None if some call would happen on Ascend too."""
    if record.calls or not record.chains:
        return None
    found = []
    for chain in record.chains:
        native = next((op for op in chain if ascend_support(op, version) in ASCEND_HAS), None)
        if native is None:
            return None
        found.append(native)
    return ", ".join(sorted(set(found)))


def classify(record, *, top: int = 3, version: str | None = None) -> Row:
    """The report row of a census.OpRecord."""
    npu, detail = npu_dispatch(record.op)
    ascend = ascend_support(record.op, version)
    parent = None
    if ascend not in ASCEND_HAS:
        parent = _inside_ascend_op(record, version)
        if parent is not None:
            ascend = "via-parent"
    return Row(op=record.op, status=status_of(record.op, npu, ascend), npu=npu, ascend=ascend,
               calls=record.calls, inner=record.inner, forward=record.phases.get("forward", 0),
               backward=record.phases.get("backward", 0),
               optimizer=record.phases.get("optimizer", 0), other=record.phases.get("other", 0),
               modules=", ".join(f"{name} {count}x" for count, name in record.top_modules(top)),
               dtypes=" ".join(sorted(record.dtypes)), devices=" ".join(sorted(record.devices)),
               signatures=format_signatures(record, top), npu_detail=detail,
               note=_note(record.op, ascend, record.devices, parent))


def _note(op: str, ascend: str, devices, parent: str | None) -> str:
    if "npu" not in devices and devices:
        return "ran on " + "/".join(sorted(devices)) + " tensors only, not on npu"
    if ascend == "via-parent":
        parent = parent or PARENTS[op]
        return f"on Ascend, {parent} has a kernel of its own and does not decompose into this"
    if ascend == "cpu-fallback":
        return "not in op-plugin: Ascend's torch_npu runs it on the host CPU (copies, a warning)"
    if ascend == "not-in-op-plugin":
        return "an npu op that op-plugin does not list"
    return ""
