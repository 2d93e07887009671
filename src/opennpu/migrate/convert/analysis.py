"""Analysis of the original code: rows of unsupported_api.csv, unknown_api.csv and
api_performance_advice.csv.

* unsupported: a reference whose qualified name is listed in ``rules/unsupported_api.json``
  (exact, or below a ``prefix.*`` key); a ``torch.cuda.X`` that exists in the installed torch but
  not in ``torch.npu`` (opennpu's device module), so the converted ``torch.npu.X`` would fail;
  and comparisons with the string ``'nccl'``.
* unknown: a reference whose qualified name (from an import, through aliases) starts with
  ``torch.`` and does not resolve in the installed torch: importing the longest importable module
  prefix and reading the remaining attributes fails. Only names the code refers to are checked
  (the outermost node of a dotted chain; import statements themselves are not rows), and only
  names resolved through imports: `layer = nn.Linear; layer.weight` is not checked.
* performance: qualified names listed in ``rules/performance_advice.json`` plus the code-shape
  matchers below, each named in its tip (``[norm.rms_norm]`` ...).
"""

from __future__ import annotations

import importlib
import re
from functools import lru_cache

import libcst as cst
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from . import rules as rules_mod
from .transformer import dotted_name, qualified_names


@lru_cache(maxsize=None)
def _torch():
    try:
        import torch
        return torch
    except Exception:  # noqa: BLE001 - without torch, nothing is classified as unknown
        return None


@lru_cache(maxsize=4096)
def resolves(qualified: str) -> bool | None:
    """Whether `qualified` (torch.x.y) names something in the installed torch; None without torch."""
    if _torch() is None:
        return None
    parts = qualified.split(".")
    obj = None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 - ImportError, or a module failing at import
            continue
        rest = parts[i:]
        break
    else:
        return False
    for name in rest:
        try:
            obj = getattr(obj, name)
        except Exception:  # noqa: BLE001
            return False
    return True


def _missing_on_npu(qualified: str) -> bool:
    """torch.cuda.X exists in torch but torch.npu (opennpu's device module) has no X."""
    torch = _torch()
    npu = getattr(torch, "npu", None) if torch is not None else None
    if npu is None or not qualified.startswith("torch.cuda."):
        return False
    obj = npu
    for name in qualified.split(".")[2:]:
        if not hasattr(obj, name):
            return resolves(qualified) is True
        obj = getattr(obj, name)
    return False


_SOFTMAX = re.compile(r"\bsoftmax\s*\(")
_MATMUL = re.compile(r"@|\bmatmul\s*\(|\bbmm\s*\(|\beinsum\s*\(")
_TRANSPOSE = re.compile(r"\.transpose\s*\(|\.mT\b|\.T\b|\.permute\s*\(")
_RSQRT = re.compile(r"\brsqrt\s*\(")
_SQUARE = re.compile(r"\.pow\s*\(\s*2\s*\)|\*\*\s*2\b|\bsquare\s*\(")
_MEAN = re.compile(r"\bmean\s*\(")
_ROTATE = re.compile(r"\bcat\s*\(\s*[\(\[]\s*-")


class Analyser(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(self, aliases: dict[str, str], module: cst.Module):
        super().__init__()
        self.aliases = aliases
        self.module = module
        self.unsupported: list[tuple[int, int, str, str]] = []
        self.unknown: list[tuple[int, int, str]] = []
        self.performance: list[tuple[int, int, str, str]] = []
        self.used_apis: set[str] = set()
        self._table, self._nccl_tip = rules_mod.unsupported_apis()
        advice = rules_mod.performance_advice()
        self._api_advice = advice["apis"]
        self._pattern_tips = advice["patterns"]
        self._in_import = 0
        self._seen: set = set()

    def _lines(self, node) -> tuple[int, int]:
        pos = self.get_metadata(PositionProvider, node)
        return pos.start.line, pos.end.line

    def _add(self, table: list, node, *row):
        key = (id(table), *self._lines(node), row[0])
        if key not in self._seen:
            self._seen.add(key)
            table.append((*self._lines(node), *row))

    def _advise(self, node, rule: str, op: str, tip: str | None = None):
        self._add(self.performance, node, op, f"[{rule}] {tip or self._pattern_tips[rule]}")

    # imports are not rows; the names they bind are checked where they are used
    def visit_Import(self, node):
        self._in_import += 1

    def leave_Import(self, node):
        self._in_import -= 1

    def visit_ImportFrom(self, node):
        self._in_import += 1

    def leave_ImportFrom(self, node):
        self._in_import -= 1

    def visit_Name(self, node):
        self._reference(node)

    def visit_Attribute(self, node):
        self._reference(node)

    def _reference(self, node):
        if self._in_import:
            return
        parent = self.get_metadata(ParentNodeProvider, node, None)
        if isinstance(parent, cst.Attribute) and parent.value is node:
            return  # not the outermost node of its dotted chain
        direct = qualified_names(self, {}, node)  # through imports only, not `CD = torch.cuda`
        for name in qualified_names(self, self.aliases, node):
            self.used_apis.add(name)
            tip = self._table.get(name)
            if tip is None:
                for key, value in self._table.items():
                    if key.endswith(".*") and name.startswith(key[:-1]):
                        tip = value
                        break
            if tip is not None:
                self._add(self.unsupported, node, name, tip)
            elif name.startswith("torch.") and name in direct:
                if resolves(name) is False:
                    self._add(self.unknown, node, name)
                elif _missing_on_npu(name):
                    self._add(self.unsupported, node, name,
                              f"torch.npu has no {name[len('torch.cuda.'):]}: the converted "
                              f"torch.npu.{name[len('torch.cuda.'):]} fails on this NPU device")
            if name in self._api_advice:
                rule, tip = self._api_advice[name]
                self._advise(node, rule, name, tip)

    # comparisons such as `backend == 'nccl'`
    def visit_Comparison(self, node):
        operands = [node.left] + [c.comparator for c in node.comparisons]
        values = []
        for operand in operands:
            elements = operand.elements if isinstance(operand, (cst.Tuple, cst.List, cst.Set)) else ()
            for item in [operand, *(e.value for e in elements)]:
                if isinstance(item, cst.SimpleString):
                    try:
                        values.append(item.evaluated_value)
                    except Exception:  # noqa: BLE001
                        pass
        if any(isinstance(v, str) and v.lower() == "nccl" for v in values):
            self._add(self.unsupported, node, self.module.code_for_node(node).strip(), self._nccl_tip)

    # code-shape matchers for the fused ops
    def visit_ClassDef(self, node):
        for stmt in node.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                code = self.module.code_for_node(stmt)
                if _RSQRT.search(code) and _SQUARE.search(code) and _MEAN.search(code):
                    self._advise(node, "norm.rms_norm", f"class {node.name.value}")

    def visit_FunctionDef(self, node):
        name = node.name.value
        code = self.module.code_for_node(node)
        if name in ("rotate_half", "apply_rotary_pos_emb") or _ROTATE.search(code):
            self._advise(node, "rotary.rotary_mul", f"def {name}")
        if _SOFTMAX.search(code) and len(_MATMUL.findall(code)) >= 2 and _TRANSPOSE.search(code):
            self._advise(node, "attention.fusion", f"def {name}")

    def visit_BinaryOperation(self, node):
        if not isinstance(node.operator, cst.Multiply):
            return
        for side in (node.left, node.right):
            if isinstance(side, cst.Call) and (dotted_name(side.func) or "").split(".")[-1] == "silu":
                self._advise(node, "activation.swiglu", self.module.code_for_node(node).strip())
                return
