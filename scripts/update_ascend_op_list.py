#!/usr/bin/env python3
"""Derive opennpu's Ascend op list (src/opennpu/analyze/data/ascend_ops_<version>.json) from
op-plugin's `op_plugin/config/op_plugin_functions.yaml` and, optionally, torch_npu's
`torch_npu/csrc/aten/npu_native_functions.yaml`.

    git -C op-plugin show 26.1.0:op_plugin/config/op_plugin_functions.yaml > /tmp/opp.yaml
    git -C pytorch show v2.11.0:torch_npu/csrc/aten/npu_native_functions.yaml > /tmp/tnpu.yaml
    python scripts/update_ascend_op_list.py --op-plugin-yaml /tmp/opp.yaml \
        --op-plugin-ref 26.1.0@<commit> --torch-npu-yaml /tmp/tnpu.yaml \
        --torch-npu-ref v2.11.0@<commit> --torch-version v2.11

Only operator names (`name.overload`) are written, never the yaml itself.

What op-plugin's yaml says: its sections `official`, `autograd`, `symint` and `quant` list ATen
functions (`aten::<func>`), `custom` lists torch_npu's own ops (`npu::<func>`; the
`symint` section holds both kinds: its npu_* / _npu_* names are npu ops). Each entry names
the PyTorch versions it is built for per implementation kind (`acl_op`: the ACL graph-op kernel,
`op_api`: the aclnn kernel): `all_version`, a single version, a comma list, or a range
`[v2.1, newest]` / `[v2.1, v2.6]` over the yaml's `all_version` list. An op is listed for
`--torch-version` when either kind covers that version.

torch_npu's npu_native_functions.yaml lists the framework ops torch_npu implements itself
(`supported:` empty, view, as_strided, copy_, _to_copy ...; `custom:` npu ops such as
npu_format_cast); its entries carry no versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

import yaml

ATEN_SECTIONS = ("official", "autograd", "symint", "quant")
IMPLEMENTATIONS = ("acl_op", "op_api")


def op_name(func: str) -> str:
    """`add.Tensor(Tensor self, ...) -> Tensor` -> `add.Tensor`; a bare `view` stays `view`."""
    return func.split("(", 1)[0].strip()


def _versions(spec, all_versions: list[str]) -> set[str]:
    """The versions one acl_op / op_api value names."""
    if spec is None or spec is False:
        return set()
    if spec is True or spec == "all_version":
        return set(all_versions)
    if isinstance(spec, list):
        if len(spec) == 2 and spec[0] in all_versions and \
                (spec[1] == "newest" or spec[1] in all_versions):
            first = all_versions.index(spec[0])
            last = len(all_versions) - 1 if spec[1] == "newest" else all_versions.index(spec[1])
            return set(all_versions[first:last + 1])
        return {str(v) for v in spec}
    return {v.strip() for v in str(spec).split(",") if v.strip()}


def _namespace(section: str, name: str, default: str) -> str:
    """`symint` mixes ATen functions (embedding) with torch_npu's own (npu_gather_backward):
    torch_npu's are the npu_* / _npu_* names."""
    if section == "symint" and name.lstrip("_").startswith("npu_"):
        return "npu"
    return default


def op_plugin_ops(document: dict, torch_version: str) -> dict[str, list[str]]:
    """{"aten": [...], "npu": [...]} of op-plugin's entries built for `torch_version`."""
    all_versions = [str(v) for v in document.get("all_version", [])]
    if torch_version not in all_versions:
        raise SystemExit(f"update_ascend_op_list: {torch_version} is not in the yaml's all_version "
                         f"list {all_versions}")
    found: dict[str, set[str]] = {"aten": set(), "npu": set()}
    for section, namespace in [*((s, "aten") for s in ATEN_SECTIONS), ("custom", "npu")]:
        for entry in document.get(section) or []:
            if not isinstance(entry, dict) or "func" not in entry:
                continue
            if any(torch_version in _versions(entry.get(kind), all_versions)
                   for kind in IMPLEMENTATIONS):
                name = op_name(entry["func"])
                found[_namespace(section, name, namespace)].add(name)
    return {namespace: sorted(names) for namespace, names in found.items()}


def torch_npu_ops(document: dict) -> dict[str, list[str]]:
    """{"aten": [...], "npu": [...]} of torch_npu's own npu_native_functions.yaml."""
    found: dict[str, set[str]] = {"aten": set(), "npu": set()}
    for section, namespace in (("supported", "aten"), ("symint", "aten"), ("autograd", "aten"),
                               ("custom", "npu"), ("custom_autograd", "npu")):
        for entry in document.get(section) or []:
            func = entry.get("func") if isinstance(entry, dict) else entry
            if isinstance(func, str):
                found[namespace].add(op_name(func))
    return {namespace: sorted(names) for namespace, names in found.items()}


def _ref(text: str) -> dict[str, str]:
    match = re.fullmatch(r"([^@]+)@([0-9a-f]{7,40})", text)
    if match is None:
        raise SystemExit(f"update_ascend_op_list: a ref is <branch>@<commit>, got {text!r}")
    return {"branch": match.group(1), "commit": match.group(2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op-plugin-yaml", required=True, type=Path)
    parser.add_argument("--op-plugin-ref", required=True,
                        help="<branch>@<commit> of Ascend/op-plugin")
    parser.add_argument("--torch-npu-yaml", type=Path)
    parser.add_argument("--torch-npu-ref", help="<branch>@<commit> of Ascend/pytorch")
    parser.add_argument("--torch-version", default="v2.11", help="the PyTorch version to list for")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("-o", "--output", type=Path,
                        help="default: src/opennpu/analyze/data/ascend_ops_<torch-version>.json")
    args = parser.parse_args(argv)

    data = {
        "torch_version": args.torch_version,
        "date": args.date,
        "generator": "scripts/update_ascend_op_list.py",
        "sources": {"op_plugin": {"repository": "https://github.com/Ascend/op-plugin",
                                  "path": "op_plugin/config/op_plugin_functions.yaml",
                                  **_ref(args.op_plugin_ref)}},
        "op_plugin": op_plugin_ops(yaml.safe_load(args.op_plugin_yaml.read_text()),
                                   args.torch_version),
    }
    if args.torch_npu_yaml is not None:
        if not args.torch_npu_ref:
            raise SystemExit("update_ascend_op_list: --torch-npu-yaml needs --torch-npu-ref")
        data["sources"]["torch_npu"] = {"repository": "https://github.com/Ascend/pytorch",
                                        "path": "torch_npu/csrc/aten/npu_native_functions.yaml",
                                        **_ref(args.torch_npu_ref)}
        data["torch_npu"] = torch_npu_ops(yaml.safe_load(args.torch_npu_yaml.read_text()))
    output = args.output or (Path(__file__).resolve().parent.parent / "src" / "opennpu" / "analyze"
                             / "data" / f"ascend_ops_{args.torch_version.lstrip('v')}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    counts = ", ".join(f"{key} {ns}: {len(names)}" for key in ("op_plugin", "torch_npu")
                       for ns, names in data.get(key, {}).items())
    print(f"wrote {output} ({counts})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
