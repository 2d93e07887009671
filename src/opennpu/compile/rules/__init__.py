"""The built-in fusion rules, one module per op family. Importing this package registers them."""

from __future__ import annotations

from . import attention, linear, norm, rotary, softmax, swiglu, torchair, transpose  # noqa: F401,E402


def rule_names() -> list[str]:
    from ..rule_registry import _RULES

    return list(_RULES)
