"""The LibCST rewriter: one pass over a module applies every active rule of :mod:`.rules`.

``convert_source(text)`` parses a file, runs the analysis of :mod:`.analysis` (unsupported,
unknown and performance rows) on the original tree, then :class:`FileConverter`, and returns a
:class:`FileResult` with the new text and the rows of every report. Names are resolved through
aliases with LibCST's ``QualifiedNameProvider`` (``import torch as t``, ``from torch import cuda``,
``from torch.cuda.amp import GradScaler``) plus simple ``CD = torch.cuda`` assignments.
"""

from __future__ import annotations

import dataclasses

import libcst as cst
from libcst.metadata import (MetadataWrapper, PositionProvider, QualifiedNameProvider,
                             QualifiedNameSource)

from . import rules as rules_mod

# Ascend's -v choices (current and earlier generations); the conversion rules do not depend on
# it (the '2.1.0' feature switch of the real tool is always on there too), it is logged.
VERSIONS = ("1.11.0", "2.0.1", "2.1.0", "2.6.0", "2.7.1", "2.8.0")
DEFAULT_VERSION = "2.8.0"

INSERT, MODIFY, DELETE = "INSERT", "MODIFY", "DELETE"


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    specify_device: bool = False
    distributed: bool = False
    version: str = DEFAULT_VERSION

    @property
    def switches(self) -> frozenset[str]:
        on = {"normal"}
        if self.specify_device:
            on.add("specify_device")
        if self.distributed:
            on.add("distributed")
        return frozenset(on)


@dataclasses.dataclass
class FileResult:
    """One file: its text before and after, and its rows for each report (lines are 1-based)."""
    path: str
    source: str
    converted: str
    changes: list[tuple[int, int, str, str]] = dataclasses.field(default_factory=list)
    unsupported: list[tuple[int, int, str, str]] = dataclasses.field(default_factory=list)
    unknown: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)
    performance: list[tuple[int, int, str, str]] = dataclasses.field(default_factory=list)
    used_apis: set[str] = dataclasses.field(default_factory=set)
    error: str | None = None

    @property
    def changed(self) -> bool:
        return self.converted != self.source


def dotted_name(node: cst.BaseExpression | None) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def _imported_module_names(stmt: cst.CSTNode) -> list[str]:
    names = []
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Import):
                names += [dotted_name(a.name) or "" for a in small.names]
            elif isinstance(small, cst.ImportFrom) and not small.relative:
                names.append(dotted_name(small.module) or "")
    return names


def _is_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


class Scanner(cst.CSTVisitor):
    """What the rewrite needs to know beforehand: the first torch import, existing imports and
    simple module aliases (``CD = torch.cuda``)."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider,)

    def __init__(self):
        self.first_torch_import: cst.SimpleStatementLine | None = None
        self.has_torch_npu = False
        self.imports_os = False
        self.defines_device_id = False
        self.aliases: dict[str, str] = {}

    def visit_SimpleStatementLine(self, node):
        modules = _imported_module_names(node)
        if self.first_torch_import is None and any(_is_torch(m) for m in modules):
            self.first_torch_import = node
        if any(m == "torch_npu" or m.startswith("torch_npu.") for m in modules):
            self.has_torch_npu = True
        for small in node.body:
            if isinstance(small, cst.Import) and any(
                    dotted_name(a.name) == "os" and a.asname is None for a in small.names):
                self.imports_os = True
            if isinstance(small, cst.Assign) and len(small.targets) == 1:
                target = small.targets[0].target
                if isinstance(target, cst.Name):
                    if target.value == "DEVICE_ID":
                        self.defines_device_id = True
                    if isinstance(small.value, (cst.Name, cst.Attribute)):
                        names = {q.name for q in self.get_metadata(QualifiedNameProvider, small.value, set())
                                 if q.source == QualifiedNameSource.IMPORT}
                        if len(names) == 1:
                            self.aliases[target.value] = names.pop()


def qualified_names(visitor: cst.MetadataDependent, aliases: dict[str, str], node) -> set[str]:
    """Imported qualified names of a dotted `node` (a.b.c, no calls in it), with `CD = torch.cuda`
    style aliases resolved. (LibCST also names `t.zeros(3).cuda` 'torch.zeros.cuda'; that is not
    a reference to an API, so chains with calls get no name here.)"""
    out = set()
    if dotted_name(node) is None:
        return out
    for q in visitor.get_metadata(QualifiedNameProvider, node, set()):
        if q.source == QualifiedNameSource.IMPORT:
            out.add(q.name)
        elif q.source == QualifiedNameSource.LOCAL and "<" not in q.name:
            head, _, rest = q.name.partition(".")
            if head in aliases:
                out.add(aliases[head] + ("." + rest if rest else ""))
    if not out and isinstance(node, cst.Attribute):
        # LibCST names no `torch.cuda` where `import torch.cuda` comes later in the same scope
        # (it looks only for that import); the name then follows from `torch`'s own.
        out = {f"{q}.{node.attr.value}" for q in qualified_names(visitor, aliases, node.value)}
    return out


def _string_literal(node) -> str | None:
    if isinstance(node, cst.SimpleString) and "b" not in node.prefix.lower():
        try:
            value = node.evaluated_value
        except Exception:  # noqa: BLE001 - an odd literal is simply not a device string
            return None
        return value if isinstance(value, str) else None
    return None


def _is_guard(node) -> bool:
    """True for the runtime guard this converter writes: f'npu:{X}' if isinstance(X, int) else X."""
    return (isinstance(node, cst.IfExp) and isinstance(node.test, cst.Call)
            and dotted_name(node.test.func) == "isinstance")


def _simple_reference(node) -> bool:
    """A name, attribute chain or subscript of them: evaluating it twice has no side effects."""
    if isinstance(node, cst.Name):
        return True
    if isinstance(node, cst.Attribute):
        return _simple_reference(node.value)
    if isinstance(node, cst.Subscript):
        return _simple_reference(node.value) and all(
            isinstance(e.slice, cst.Index) and isinstance(e.slice.value, (cst.Integer, cst.Name))
            for e in node.slice)
    return False


class FileConverter(cst.CSTTransformer):
    """Applies a RuleSet to one module and records a change_list row per edit."""

    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

    def __init__(self, ruleset: rules_mod.RuleSet, scan: Scanner, module: cst.Module):
        super().__init__()
        self.rules = ruleset
        self.scan = scan
        self.module = module
        self.changes: list[tuple[int, int, str, str]] = []
        self.uses_device_id = False
        self._in_import = 0
        self._dropped: set[int] = set()
        self._in_fstring = 0

    # -- helpers ----------------------------------------------------------------------------
    def _record(self, node, op: str, message: str):
        pos = self.get_metadata(PositionProvider, node)
        self.changes.append((pos.start.line, pos.end.line, op, message))

    def _qnames(self, node) -> set[str]:
        return qualified_names(self, self.scan.aliases, node)

    def _code(self, node) -> str:
        return self.module.code_for_node(node)

    def _rename_module(self, name: str) -> str | None:
        for rule in self.rules.module_names:
            old = rule.old_module
            if name == old or name.startswith(old + "."):
                return rule.new_module + name[len(old):]
        return None

    # -- imports ----------------------------------------------------------------------------
    def visit_Import(self, node):
        self._in_import += 1

    def leave_Import(self, original_node, updated_node):
        self._in_import -= 1
        names = []
        for alias in updated_node.names:
            old = dotted_name(alias.name)
            new = self._rename_module(old) if old else None
            if new:
                alias = alias.with_changes(name=cst.parse_expression(new))
                self._record(original_node, MODIFY, f"change import {old} to {new}")
            names.append(alias)
        return updated_node.with_changes(names=names)

    def visit_ImportFrom(self, node):
        self._in_import += 1

    def leave_ImportFrom(self, original_node, updated_node):
        self._in_import -= 1
        if updated_node.relative or updated_node.module is None:
            return updated_node
        module = dotted_name(updated_node.module)
        new = self._rename_module(module)
        if new:
            self._record(original_node, MODIFY, f"change from {module} import to from {new} import")
            return updated_node.with_changes(module=cst.parse_expression(new))
        if isinstance(updated_node.names, cst.ImportStar):
            return updated_node
        names = []
        for alias in updated_node.names:
            imported = dotted_name(alias.name)
            new = self._rename_module(f"{module}.{imported}")
            if new and new.startswith(module + "."):
                new_leaf = new[len(module) + 1:]
                asname = alias.asname or cst.AsName(name=cst.Name(imported))
                alias = alias.with_changes(name=cst.Name(new_leaf), asname=asname)
                self._record(original_node, MODIFY,
                             f"change from {module} import {imported} to import {new_leaf} as "
                             f"{asname.name.value}")
            names.append(alias)
        return updated_node.with_changes(names=names)

    def leave_SimpleStatementLine(self, original_node, updated_node):
        body = []
        for small in updated_node.body:
            if isinstance(small, cst.Import) and self.rules.removed_imports:
                removed = {r.module for r in self.rules.removed_imports}
                kept = [a for a in small.names if (dotted_name(a.name) or "").split(".")[0] not in removed]
                if len(kept) != len(small.names):
                    gone = [dotted_name(a.name) for a in small.names if a not in kept]
                    self._record(original_node, DELETE, f"import {', '.join(gone)} has been removed")
                    if not kept:
                        continue
                    kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                    small = small.with_changes(names=kept)
            body.append(small)
        if not body:  # dropped by the enclosing block, which keeps the blank lines above it
            placeholder = updated_node.with_changes(body=[cst.Pass()])
            self._dropped.add(id(placeholder))
            return placeholder
        if len(body) != len(updated_node.body):
            body[-1] = body[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
        updated_node = updated_node.with_changes(body=body)
        if original_node is self.scan.first_torch_import and not self.scan.has_torch_npu:
            inserts = [r for r in self.rules.inserts if r.where == "before_first_torch_import"]
            if inserts:
                new_stmts = []
                for rule in inserts:
                    new_stmts += list(cst.parse_module("\n".join(rule.code) + "\n").body)
                    self._record(original_node, INSERT, f"insert {'; '.join(rule.code)}")
                new_stmts[0] = new_stmts[0].with_changes(leading_lines=updated_node.leading_lines)
                return cst.FlattenSentinel([*new_stmts, updated_node.with_changes(leading_lines=())])
        return updated_node

    def _drop_removed(self, body) -> list:
        """Drops the statements emptied by RemoveImport; their leading blank and comment lines
        move to the next statement."""
        out, carry = [], []
        for stmt in body:
            if id(stmt) in self._dropped:
                carry += list(stmt.leading_lines)
                continue
            if carry:
                stmt = stmt.with_changes(leading_lines=[*carry, *stmt.leading_lines])
                carry = []
            out.append(stmt)
        return out

    def leave_IndentedBlock(self, original_node, updated_node):
        body = self._drop_removed(updated_node.body)
        if not body:  # every statement was a removed import
            body = [cst.SimpleStatementLine([cst.Pass()])]
        return updated_node.with_changes(body=body)

    def leave_Module(self, original_node, updated_node):
        updated_node = updated_node.with_changes(body=self._drop_removed(updated_node.body))
        if not (self.uses_device_id and not self.scan.defines_device_id):
            return updated_node
        rules = [r for r in self.rules.inserts if r.where == "after_imports"]
        if not rules:
            return updated_node
        body = list(updated_node.body)
        index = 0
        for i, stmt in enumerate(body):
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                break
            if _imported_module_names(stmt):
                index = i + 1
        lines = []
        for rule in rules:
            if rule.needs_import == "os" and not self.scan.imports_os:
                lines.append("import os")
            lines += rule.code
        new = list(cst.parse_module("\n".join(lines) + "\n").body)
        new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine()])
        line = 1
        for stmt in original_node.body:
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                break
            if _imported_module_names(stmt):
                line = self.get_metadata(PositionProvider, stmt).end.line
        self.changes.append((line, line, INSERT, "insert DEVICE_ID (environment variable DEVICE_ID, "
                                                 "default 0) and torch_npu.npu.set_device"))
        return updated_node.with_changes(body=body[:index] + new + body[index:])

    # -- names and attributes ---------------------------------------------------------------
    def leave_Attribute(self, original_node, updated_node):
        if self._in_import:
            return updated_node
        attr = original_node.attr.value
        for rule in self.rules.module_names:
            if attr == rule.old_name and rule.old_module in self._qnames(original_node):
                new = updated_node.with_changes(attr=cst.Name(rule.new_name))
                self._record(original_node, MODIFY,
                             f"change {self._code(original_node)} to {self._code(new)}")
                return new
        for rule in self.rules.attributes:
            if attr != rule.old_name:
                continue
            if rule.owners and not (self._qnames(original_node.value) & set(rule.owners)):
                continue
            self._record(original_node, MODIFY, f"change attribute {rule.old_name} to {rule.new_name}")
            return updated_node.with_changes(attr=cst.Name(rule.new_name))
        return updated_node

    # -- strings ----------------------------------------------------------------------------
    def leave_SimpleString(self, original_node, updated_node):
        value = _string_literal(original_node)
        if value is None:
            return updated_node
        text = updated_node.value
        start = len(updated_node.prefix) + len(updated_node.quote)
        body = text[start:len(text) - len(updated_node.quote)]
        for rule in self.rules.strings:
            if rule.strict:
                if value == rule.old:
                    self._record(original_node, MODIFY, f'replace string "{rule.old}" with "{rule.new}"')
                    return updated_node.with_changes(value=text[:start] + rule.new + text[len(text) - len(updated_node.quote):])
            elif rule.old in body:
                body = body.replace(rule.old, rule.new)
                self._record(original_node, MODIFY, f'replace string "{rule.old}" with "{rule.new}"')
        new_value = text[:start] + body + text[len(text) - len(updated_node.quote):]
        return updated_node if new_value == text else updated_node.with_changes(value=new_value)

    def leave_FormattedStringText(self, original_node, updated_node):
        value = updated_node.value
        for rule in self.rules.strings:
            if not rule.strict and rule.old in value:
                value = value.replace(rule.old, rule.new)
                self._record(original_node, MODIFY, f'replace string "{rule.old}" with "{rule.new}"')
        return updated_node.with_changes(value=value)

    def visit_FormattedString(self, node):
        self._in_fstring += 1

    def leave_FormattedString(self, original_node, updated_node):
        self._in_fstring -= 1
        return updated_node

    # -- calls ------------------------------------------------------------------------------
    def leave_Call(self, original_node, updated_node):
        func = original_node.func
        method = func.attr.value if isinstance(func, cst.Attribute) else None
        for rule in self.rules.func_names:
            if method == rule.old_name and isinstance(updated_node.func, cst.Attribute):
                updated_node = updated_node.with_changes(
                    func=updated_node.func.with_changes(attr=cst.Name(rule.new_name)))
                self._record(original_node, MODIFY, f"change function {rule.old_name} to {rule.new_name}")
        if not self.rules.args or self._in_fstring:  # no f'npu:..' nested in an f-string
            return updated_node
        qnames = None
        handled: set[int | str] = set()
        args = list(updated_node.args)
        for rule in self.rules.args:
            if rule.methods and method in rule.methods:
                pass
            elif rule.functions:
                if qnames is None:
                    qnames = self._qnames(func)
                if not qnames & set(rule.functions):
                    continue
            else:
                continue
            if rule.action == "drop_args":
                if args and "drop" not in handled:
                    self._record(original_node, MODIFY, f"delete the arguments of function {method}")
                    args = []
                handled.add("drop")
                continue
            index = self._find_arg(original_node, rule)
            if index is None or index in handled:
                continue
            handled.add(index)
            new_value = self._device_arg(rule, original_node.args[index].value, args[index].value)
            if new_value is None:
                continue
            name = method or dotted_name(func)
            where = f"position {index}" if original_node.args[index].keyword is None \
                else f"keyword {original_node.args[index].keyword.value}"
            self._record(original_node, MODIFY, f"change the arg at {where} of function {name} to "
                                                f"{self._code(new_value)}")
            args[index] = args[index].with_changes(value=new_value)
            if rule.drop_later_args and original_node.args[index].keyword is None:
                args = args[:index + 1]
        if args and len(args) != len(updated_node.args):
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated_node.with_changes(args=args)

    @staticmethod
    def _find_arg(call: cst.Call, rule: rules_mod.ArgsModify) -> int | None:
        for i, arg in enumerate(call.args):
            if arg.keyword is not None and arg.keyword.value == rule.arg_name:
                return i
        if rule.arg_idx is not None:
            positional = 0
            for i, arg in enumerate(call.args):
                if arg.keyword is not None or arg.star:
                    break
                if positional == rule.arg_idx:
                    return i
                positional += 1
        return None

    def _device_arg(self, rule, original, updated):
        """The new device argument, or None when it stays."""
        if isinstance(original, cst.FormattedString) or _is_guard(original):
            return None
        source = self._code(original)
        if rule.action == "device_id":
            literal = _string_literal(original)
            if literal is not None:
                if not literal.startswith(("cuda", "npu")):
                    return None
            elif self.rules.device_arg_whitelist.search(source) and not isinstance(original, cst.Integer):
                return None
            self.uses_device_id = True
            return cst.parse_expression("f'npu:{DEVICE_ID}'")
        if rule.action == "int_device_guard":
            if isinstance(original, cst.Integer):
                return cst.SimpleString(f"'npu:{original.value}'")
            if self.rules.device_arg_whitelist.search(source) or not _simple_reference(original):
                return None
            return cst.parse_expression(f"f'npu:{{{source}}}' if isinstance({source}, int) else {source}")
        raise ValueError(f"ArgsModify rule {rule.name!r}: unknown action {rule.action!r}")


def convert_source(source: str, options: ConvertOptions = ConvertOptions(), path: str = "<string>",
                   analyse: bool = True) -> FileResult:
    """Convert one file's text; a file LibCST cannot parse comes back unchanged with `error` set."""
    from . import analysis  # the analysis imports torch lazily, only for unknown-API checks

    result = FileResult(path=path, source=source, converted=source)
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        result.error = f"LibCST cannot parse it ({str(exc).splitlines()[0]}); skipped"
        return result
    wrapper = MetadataWrapper(module)
    scan = Scanner()
    wrapper.visit(scan)
    if analyse:
        analyser = analysis.Analyser(scan.aliases, wrapper.module)
        wrapper.visit(analyser)
        result.unsupported, result.unknown = analyser.unsupported, analyser.unknown
        result.performance, result.used_apis = analyser.performance, analyser.used_apis
    converter = FileConverter(rules_mod.load_rules(options.switches), scan, wrapper.module)
    result.converted = wrapper.visit(converter).code
    result.changes = sorted(converter.changes)
    return result
