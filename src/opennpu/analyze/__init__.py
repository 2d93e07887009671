"""Op-support analysis: which operators a program runs, how opennpu's npu device runs each, whether
Ascend's torch_npu has it, and which of graph mode's fused replacements apply.

    python -m opennpu.analyze train.py --steps 2 -o report/      (also: opennpu analyze ...)

    with opennpu.analyze.OpCensus() as census:
        loss = model(x).sum(); loss.backward(); optimizer.step()
    print(census.report("report/", formats=("csv", "html", "table")))

See docs/analyze.md.
"""

from __future__ import annotations

from .census import OpCensus, OpRecord, StopCensus, op_key
from .runner import run_script
from .support import Row, ascend_data, ascend_support, classify, npu_dispatch

__all__ = ["OpCensus", "OpRecord", "Row", "StopCensus", "ascend_data", "ascend_support",
           "classify", "npu_dispatch", "op_key", "run_script"]
