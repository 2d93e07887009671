"""Post-processing of `NPUGraph.debug_dump` traces (torch_npu's `torch_npu.npu._npugraph_utils`).

A dump is a Chrome trace: a JSON list of events, the graph's tasks as "X" spans on one track per
stream. `align_trace_json` writes a copy laid out for reading: on each track the spans follow one
another from 0 with a fixed gap (the dump's timestamps say when the host ran a call, not when a
device would), and where a task waits on another stream (an `EVENT_WAIT_<id>` span paired with an
`EVENT_RECORD_<id>` span, or `MEM_WAIT_VALUE_<id>` with `MEM_WRITE_VALUE_<id>`, the names of ACL's
dumps) the wait is stretched to end when the record ends and the rest of its track moves later;
each such pair also gets a flow arrow. The dump itself is not changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

__all__ = ["align_trace_json"]

GAP_US = 0.2  # between consecutive spans of a track, so that each task stays visible
_SIGNALS = ("EVENT_RECORD_", "MEM_WRITE_VALUE_")
_WAITS = ("EVENT_WAIT_", "MEM_WAIT_VALUE_")


def _pair_key(name: str) -> Optional[tuple[str, str]]:
    """("signal" | "wait", handle) for a synchronisation task's name, else None."""
    for kind, prefixes in (("signal", _SIGNALS), ("wait", _WAITS)):
        for prefix in prefixes:
            if name.startswith(prefix):
                return kind, name[len(prefix):].rsplit("_", 1)[-1]
    return None


def _aligned_path(path: Path) -> Path:
    name = path.name[:-len(".json")] if path.name.endswith(".json") else path.name
    return path.with_name(name + ".aligned.json")


def align_trace_json(input, output=None):  # noqa: A002  (torch_npu's parameter name)
    """Reads the trace `input` and writes its aligned copy to `output` (default: beside it, named
    `<name>.aligned.json`); returns the path written. Raises ValueError for a file that is not a
    trace and RuntimeError when the waits cannot be satisfied (a cycle of waits)."""
    in_path = Path(input)
    out_path = Path(output) if output else _aligned_path(in_path)
    with in_path.open("r", encoding="utf-8") as f:
        trace = json.load(f)
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"align_trace_json: {in_path} is not a Chrome trace (expected a JSON "
                         f"list of event objects, or an object with 'traceEvents')")

    spans = [e for e in events if e.get("ph") == "X"]
    tracks: dict = {}
    for order, e in enumerate(spans):
        tracks.setdefault(e.get("tid"), []).append((float(e.get("ts", 0.0)), order, e))
    lanes = {tid: [e for _, _, e in sorted(items, key=lambda t: t[:2])]
             for tid, items in tracks.items()}
    for lane in lanes.values():  # back to back from 0, in the dump's order
        t = 0.0
        for i, e in enumerate(lane):
            e["dur"] = max(float(e.get("dur", 0.0)), 0.0)
            e["ts"] = t if i == 0 else t + GAP_US
            t = e["ts"] + e["dur"]

    pairs: dict = {}
    for e in spans:
        key = _pair_key(str(e.get("name", "")))
        if key is not None:
            pairs.setdefault(key[1], {})[key[0]] = e
    cross = [(h, p["signal"], p["wait"]) for h, p in pairs.items()
             if "signal" in p and "wait" in p and p["signal"].get("tid") != p["wait"].get("tid")]
    position = {id(e): (tid, i) for tid, lane in lanes.items() for i, e in enumerate(lane)}
    # Each pass only moves spans later; without a cycle of waits it settles within len(cross)+1.
    for _ in range(len(cross) + 1):
        moved = False
        for _, signal, wait in cross:
            late = signal["ts"] + signal["dur"] - (wait["ts"] + wait["dur"])
            if late > 1e-9:
                wait["dur"] += late
                tid, i = position[id(wait)]
                for later in lanes[tid][i + 1:]:
                    later["ts"] += late
                moved = True
        if not moved:
            break
    else:
        raise RuntimeError(f"align_trace_json: the waits of {in_path} form a cycle (a task waits, "
                           f"through other streams, on itself)")

    for handle, signal, wait in cross:
        flow = {"name": f"{signal['name']} -> {wait['name']}", "cat": "sync", "id": str(handle)}
        events.append({**flow, "ph": "s", "pid": signal.get("pid"), "tid": signal.get("tid"),
                       "ts": signal["ts"] + signal["dur"]})
        events.append({**flow, "ph": "f", "bp": "e", "pid": wait.get("pid"),
                       "tid": wait.get("tid"), "ts": wait["ts"] + wait["dur"]})

    with out_path.open("w", encoding="utf-8") as f:
        json.dump(trace, f, indent=1)
    return out_path
