"""torch.ops.npu against op-plugin's schemas (tests/data/op_plugin_schemas.txt, lines of its
op_plugin_functions.yaml), and torch.ops.atb against its ATB ops' (tests/data/atb_schemas.txt,
from op_plugin/ops/atb/*.cpp): same ops, same argument names, types, defaults and returns.

One deliberate difference: where op-plugin says `int` for a size that torch.compile(dynamic=True)
must carry symbolically (npu_fusion_attention's seed / offset / numels, npu_moe_init_routing's
active_num, the MoE permute gradients' *_size_0), opennpu declares `SymInt`; Python callers see
an int either way."""

from pathlib import Path

import pytest
import torch

import opennpu  # noqa: F401

_LIST = Path(__file__).parent.parent / "data" / "op_plugin_schemas.txt"
_ATB_LIST = Path(__file__).parent.parent / "data" / "atb_schemas.txt"


def _expected(path=_LIST) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            schema = torch._C.parse_schema(line)
            name = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
            assert name not in out, f"{name} listed twice in {path.name}"
            out[name] = str(schema)
    return out


def _registered(namespace="npu") -> dict[str, str]:
    out = {}
    ns = getattr(torch.ops, namespace)
    for name in dir(ns):
        packet = getattr(ns, name)
        if name.startswith("__") or not hasattr(packet, "overloads"):
            continue
        for overload in packet.overloads():
            schema = getattr(packet, overload)._schema
            key = name if overload == "default" else f"{name}.{overload}"
            out[key] = str(schema).replace(f"{namespace}::", "", 1).replace("SymInt", "int")
    return out


EXPECTED = _expected()
REGISTERED = _registered()


def test_every_registered_op_is_listed():
    assert sorted(set(REGISTERED) - set(EXPECTED)) == []


def test_every_listed_op_is_registered():
    assert sorted(set(EXPECTED) - set(REGISTERED)) == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_schema_equals_op_plugin(name):
    if name not in REGISTERED:
        pytest.fail(f"torch.ops.npu.{name} is not registered")
    assert REGISTERED[name] == EXPECTED[name].replace("SymInt", "int")


ATB_EXPECTED = _expected(_ATB_LIST)
ATB_REGISTERED = _registered("atb")


def test_atb_ops_are_exactly_the_listed_ones():
    assert sorted(ATB_REGISTERED) == sorted(ATB_EXPECTED)


@pytest.mark.parametrize("name", sorted(ATB_EXPECTED))
def test_atb_schema_equals_op_plugin(name):
    assert ATB_REGISTERED.get(name) == ATB_EXPECTED[name]
