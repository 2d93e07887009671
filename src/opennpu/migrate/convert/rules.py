"""The conversion rules: data in ``rules/*.json``, loaded here into small rule objects.

Rule kinds are msFmkTransplt's (spec migration.md §1.5): ModuleNameModify, FuncNameModify,
ReplaceString, ReplaceAttribute, ArgsModify, Insert and RemoveImport. Every rule carries a
``feature_switch`` list; it is active when one of its switches is on: ``normal`` is always on,
``specify_device`` with ``-s``, ``distributed`` with the ``distributed`` sub-command.
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import lru_cache
from pathlib import Path

RULES_DIR = Path(__file__).with_name("rules")


@dataclasses.dataclass(frozen=True)
class ModuleNameModify:
    """An attribute ``<parent_module>.<old_name>`` (through any alias) becomes ``...<new_name>``;
    import statements of the module are rewritten the same way."""
    name: str
    old_name: str
    new_name: str
    parent_module: str

    @property
    def old_module(self) -> str:
        return f"{self.parent_module}.{self.old_name}"

    @property
    def new_module(self) -> str:
        return f"{self.parent_module}.{self.new_name}"


@dataclasses.dataclass(frozen=True)
class FuncNameModify:
    """A method call ``x.<old_name>(...)`` becomes ``x.<new_name>(...)``."""
    name: str
    old_name: str
    new_name: str


@dataclasses.dataclass(frozen=True)
class ReplaceString:
    """A string literal equal to ``old`` (strict) or containing it (not strict; also the text parts
    of f-strings) gets ``new`` instead."""
    name: str
    old: str
    new: str
    strict: bool


@dataclasses.dataclass(frozen=True)
class ReplaceAttribute:
    """Attribute ``.old_name`` becomes ``.new_name``; with ``owners``, only when the object the
    attribute is read from resolves to one of them."""
    name: str
    old_name: str
    new_name: str
    owners: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ArgsModify:
    """Rewrites the device argument (position ``arg_idx`` or keyword ``arg_name``) of the named
    methods or functions. Actions: ``int_device_guard`` (X -> f'npu:{X}' if isinstance(X, int)
    else X), ``device_id`` (X -> f'npu:{DEVICE_ID}'), ``drop_args`` (all arguments removed)."""
    name: str
    action: str
    methods: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()
    arg_idx: int | None = None
    arg_name: str | None = None
    drop_later_args: bool = False


@dataclasses.dataclass(frozen=True)
class Insert:
    """Lines of code inserted ``before_first_torch_import`` or ``after_imports``."""
    name: str
    where: str
    code: tuple[str, ...]
    needs_import: str | None = None


@dataclasses.dataclass(frozen=True)
class RemoveImport:
    """``import <module>`` is deleted (a block left empty gets ``pass``)."""
    name: str
    module: str


_KINDS = {cls.__name__: cls for cls in
          (ModuleNameModify, FuncNameModify, ReplaceString, ReplaceAttribute, ArgsModify, Insert,
           RemoveImport)}


@dataclasses.dataclass(frozen=True)
class RuleSet:
    module_names: tuple[ModuleNameModify, ...]
    func_names: tuple[FuncNameModify, ...]
    strings: tuple[ReplaceString, ...]
    attributes: tuple[ReplaceAttribute, ...]
    args: tuple[ArgsModify, ...]
    inserts: tuple[Insert, ...]
    removed_imports: tuple[RemoveImport, ...]
    device_arg_whitelist: re.Pattern


def _load_json(name: str) -> dict:
    with open(RULES_DIR / name, encoding="utf-8") as f:
        return json.load(f)


def _build(kind: str, entry: dict, source: str):
    cls = _KINDS[kind]
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in entry.items() if k != "feature_switch"}
    unknown = set(values) - fields
    if unknown:
        raise ValueError(f"{source}: {kind} rule {entry.get('name')!r} has unknown keys "
                         f"{sorted(unknown)}; expected some of {sorted(fields)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


@lru_cache(maxsize=None)
def load_rules(switches: frozenset[str] = frozenset({"normal"}), name: str = "common.json") -> RuleSet:
    """The active rules of ``rules/<name>`` for the given feature switches."""
    data = _load_json(name)
    active: dict[str, list] = {kind: [] for kind in _KINDS}
    for kind in _KINDS:
        for entry in data.get(kind, []):
            if "feature_switch" not in entry:
                raise ValueError(f"{name}: {kind} rule {entry.get('name')!r} has no feature_switch")
            if switches.intersection(entry["feature_switch"]):
                active[kind].append(_build(kind, entry, name))
    return RuleSet(
        module_names=tuple(active["ModuleNameModify"]), func_names=tuple(active["FuncNameModify"]),
        strings=tuple(active["ReplaceString"]), attributes=tuple(active["ReplaceAttribute"]),
        args=tuple(active["ArgsModify"]), inserts=tuple(active["Insert"]),
        removed_imports=tuple(active["RemoveImport"]),
        device_arg_whitelist=re.compile(data["device_arg_whitelist"]))


@lru_cache(maxsize=None)
def unsupported_apis() -> tuple[dict[str, str], str]:
    """(qualified name or 'prefix.*' -> tip, tip for comparisons with 'nccl')."""
    data = _load_json("unsupported_api.json")
    return data["unsupported"], data["nccl_comparison"]


@lru_cache(maxsize=None)
def performance_advice() -> dict:
    return _load_json("performance_advice.json")
