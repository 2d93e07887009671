"""Graph capture of `torch.npu` (torch_npu's ACL graphs, with torch.cuda.graphs' semantics).

On Ascend, `NPUGraph` records the kernels launched on a capturing stream into an ACL model
(aclmdlRI) and `replay()` launches them again on the same device memory. Here kernels run on the
host as they are called, so capture is emulated one level up: while a graph captures, a
TorchDispatchMode records every ATen / `torch.ops.npu` call that touches an npu tensor (the op,
its arguments and its outputs) and also runs it, so the outputs hold values at once (on Ascend
they would hold garbage until the first replay; running them is a superset). `replay()` runs the
recorded calls again, in order, on the same tensors:

- calls whose outputs only alias their inputs (views: `view`, `transpose`, `select`, ... by the
  schema's alias annotation or by sharing an input's storage) are not run again: the recorded view
  still aliases the same memory;
- allocations (`empty`, `empty_like`, `empty_strided`, ...) are not run again: on Ascend they
  launch no kernel, so replay leaves their memory alone;
- calls that write into an argument (in-place ops, `out=`) run again as recorded;
- every other call runs again and its results are copied into the tensors it returned during
  capture, which are the static outputs the caller holds.

So after new values are written into the static inputs, `replay()` computes what running the code
again would, into the captured outputs. Random ops draw again from their generator at replay (as
CUDA graphs with registered generators do): after `torch.npu.set_rng_state(s)` a replay draws what
eager code run after the same `set_rng_state(s)` draws. The dropout seed and offset that
npu_fusion_attention returns as ints reach its gradient op at replay as that replay's forward drew
them; other values returned as Python numbers keep their capture-time values in the calls that
took them.

Host functions launched on the capturing stream (`_launch_host_func`) and generator states read
and restored inside the capture (`get_rng_state` / `set_rng_state`) are recorded as host nodes,
which replay calls again at their place (see those functions).

During capture, what a capturing stream forbids raises "operation not permitted when stream is
capturing", naming the operation: host reads of npu tensors (`.item()`, `.tolist()`, `.cpu()`, any
copy to a CPU tensor), ops whose output size depends on values (`nonzero`, `masked_select`,
`unique`), and `torch.npu.synchronize()`. Calls on CPU tensors only are neither recorded nor
checked.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
import warnings
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

__all__ = ["ExternalEvent", "NPUGraph", "graph", "graph_pool_handle", "graph_task_group_begin",
           "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end",
           "is_current_stream_capturing", "make_graphed_callables"]

_aten = torch.ops.aten
_CAPTURE_MODES = ("global", "thread_local", "relaxed")
_log = logging.getLogger(__name__)
_NOT_PERMITTED = "operation not permitted when stream is capturing"

# Ops that read an npu tensor's values on the host (a device-to-host synchronisation) or whose
# output size depends on the values (which needs one): CUDA and ACL stream capture reject them.
_SYNC_OPS = {
    _aten._local_scalar_dense.default: "Tensor.item() (aten::_local_scalar_dense)",
    _aten.equal.default: "torch.equal (aten::equal returns a host bool)",
    _aten.nonzero.default: "aten::nonzero (its output size depends on the values)",
    _aten.masked_select.default: "aten::masked_select (its output size depends on the values)",
    _aten._unique2.default: "aten::unique (its output size depends on the values)",
    _aten.unique_dim.default: "aten::unique (its output size depends on the values)",
    _aten.unique_consecutive.default: "aten::unique_consecutive (its output size depends on the values)",
    _aten.repeat_interleave.Tensor: "aten::repeat_interleave (its output size depends on the values)",
}

# Allocations: on the device they launch no kernel, so a replay does not touch their memory.
_ALLOC_OPS = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.empty_permuted.default,
}

# torch_npu's update handlers (torch_npu/npu/_npugraph_handlers): the ops whose recorded calls
# NPUGraph.update(cpu_update_input=...) updates, in capture order, when the graph was captured
# with auto_dispatch_capture=True.
_UPDATABLE = ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2",
              "_npu_paged_attention", "npu_multi_head_latent_attention",
              "npu_fusion_attention_v3", "npu_fusion_attention_grad_v3")

_pool_ids = itertools.count(1)
_lock = threading.Lock()
_capturing: Optional["NPUGraph"] = None  # one capture at a time in the process, as on CUDA


def _is_npu(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "npu" and not isinstance(x, FakeTensor)


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _not_permitted(what: str) -> RuntimeError:
    return RuntimeError(f"{_NOT_PERMITTED}: {what} during NPUGraph capture (an NPU graph cannot "
                        f"synchronise with the host; move it before or after the capture)")


def _check_not_capturing(what: str, graph: Optional["NPUGraph"] = None) -> None:
    """Raises the capture error for `what` (a host synchronisation) while a graph captures in the
    calling thread (or, given `graph`, whose capture mode saw it: the autograd engine's threads
    run a captured backward under the capture's mode)."""
    if graph is None:
        graph = _capturing
        if graph is not None and graph._thread != threading.get_ident():
            graph = None
    if graph is not None:
        err = _not_permitted(what)
        graph._invalidate(err)
        raise err


class _Record:
    """One recorded call: what replay does with it is decided once, at capture."""

    __slots__ = ("func", "args", "kwargs", "outputs", "fresh", "kind", "links", "stream",
                 "device", "dur_us")

    def __init__(self, func, args, kwargs, outputs, fresh, kind):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outputs, self.fresh, self.kind = outputs, fresh, kind
        # (argument name, index of the record whose int output it took, position of that output)
        self.links: list[tuple[str, int, int]] = []
        # for debug_dump only: the stream current when the call was made, and how long the call
        # took on the host at capture (set by the capture mode)
        self.stream, self.device, self.dur_us = 0, 0, 0.0

    def trace_event(self, index: int, ts: float) -> dict:
        """This call as a Chrome trace event ("X": a span on its stream's track)."""
        def meta(x):
            if isinstance(x, torch.Tensor):
                return {"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", ""),
                        "device": str(x.device)}
            return repr(x) if not isinstance(x, (int, float, bool, str, type(None))) else x

        name = (f"HOST_FUNC {getattr(self.func, '__qualname__', self.func)}"
                if self.kind == "host" else str(self.func))
        return {"name": name, "ph": "X", "pid": self.device,
                "tid": f"stream{self.stream}", "ts": ts, "dur": self.dur_us,
                "args": {"Task Id": index, "Stream Id": self.stream, "kind": self.kind,
                         "inputs": [meta(x) for x in tree_leaves((self.args, self.kwargs))],
                         "outputs": [meta(x) for x in tree_leaves(self.outputs)]}}


def _classify(func, args, kwargs, out) -> tuple[str, list[bool]]:
    """("view" | "alloc" | "mutate" | "compute", per flattened output: whether replay copies a
    fresh result into it)."""
    outs = tree_leaves(out)
    if func in _ALLOC_OPS:
        return "alloc", [False] * len(outs)
    # An output sharing an input's storage is a view of it or the argument an in-place / out=
    # call wrote (the schema's alias annotations say the same, but _unsafe_view and some custom
    # ops alias without one).
    inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    inputs.discard(None)
    fresh = [isinstance(o, torch.Tensor) and _storage_key(o) not in inputs for o in outs]
    if func._schema.is_mutable:
        return "mutate", fresh
    if not any(fresh):
        return "view", fresh
    return "compute", fresh


class _CaptureMode(TorchDispatchMode):
    """Records (and runs) every call on npu tensors while its graph captures; between
    graph_task_update_begin and _end, collects the calls that replace a task group's."""

    def __init__(self, graph: "NPUGraph"):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        graph = self.graph
        leaves = tree_leaves((args, kwargs))
        npu_in = any(_is_npu(x) for x in leaves)
        if graph._update is not None and (npu_in or _npu_device_kwarg(kwargs)):
            return graph._update_call(func, args, kwargs)
        if npu_in:
            what = _SYNC_OPS.get(func)
            if what is not None:
                _check_not_capturing(what, graph)
        start = time.perf_counter_ns()
        out = func(*args, **kwargs)
        dur_us = (time.perf_counter_ns() - start) / 1000.0
        outs = tree_leaves(out)
        if not (npu_in or any(_is_npu(o) for o in outs)):
            return out  # CPU work: not part of a device graph
        if npu_in and any(isinstance(o, torch.Tensor) and o.device.type == "cpu" for o in outs):
            _check_not_capturing(f"a copy from npu to the host ({func}, e.g. Tensor.cpu())", graph)
        kind, fresh = _classify(func, args, kwargs, out)
        record = _Record(func, args, dict(kwargs), out, fresh, kind)
        from .streams import current_stream

        stream = current_stream()
        record.stream, record.device, record.dur_us = stream.stream_id, stream.device_index, dur_us
        record.links = _dropout_links(graph._records, func, args, kwargs)
        graph._records.append(record)
        return out


def _npu_device_kwarg(kwargs) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "npu"


@contextlib.contextmanager
def _replaying():
    """Runs recorded calls as they were recorded: below autograd (they were recorded there) and
    without autocast (they were recorded after its casts)."""
    with torch._C._AutoDispatchBelowADInplaceOrView(), \
            torch.autocast("npu", enabled=False), torch.autocast("cpu", enabled=False):
        yield


# Arguments that take the dropout seed / offset a fused attention forward returned as ints
# (npu_fusion_attention, _v2): their gradient ops must see what the forward drew at this replay.
_RNG_ARGS = ("seed", "offset")


def _int_arg(func, args, kwargs, name):
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if not a.kwarg_only and i < len(args):
                value = args[i]
            else:  # an argument equal to its default is left out of the call
                value = kwargs.get(name, a.default_value if a.has_default_value() else None)
            return value if isinstance(value, int) and not isinstance(value, bool) else None
    return None


def _dropout_links(records, func, args, kwargs) -> list[tuple[str, int, int]]:
    """Which of this call's seed / offset arguments were returned as ints by an earlier recorded
    call (the latest that returned that value): replay passes what that call returns then."""
    links = []
    for j, name in enumerate(_RNG_ARGS):
        value = _int_arg(func, args, kwargs, name)
        if value is None:
            continue
        for index in range(len(records) - 1, -1, -1):
            outs = tree_leaves(records[index].outputs)
            # the forwards return tensors, then (seed, offset, numels) as ints, in that order
            ints = [p for p, o in enumerate(outs) if type(o) is int]
            if (len(ints) > j and outs[ints[j]] == value
                    and any(isinstance(o, torch.Tensor) for o in outs)):
                links.append((name, index, ints[j]))
                break
    return links


def _with_links(record: _Record, results: dict) -> tuple[tuple, dict]:
    args, kwargs = list(record.args), dict(record.kwargs)
    names = [a.name for a in record.func._schema.arguments]
    for name, index, pos in record.links:
        if index not in results:
            continue
        value = results[index][pos]
        i = names.index(name)
        if not record.func._schema.arguments[i].kwarg_only and i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def _run(record: _Record, index: int, results: dict) -> None:
    if record.kind in ("view", "alloc"):
        return
    if record.kind == "host":  # a host function or generator-state node: called again
        record.func(*record.args)
        return
    args, kwargs = (_with_links(record, results) if record.links
                    else (record.args, record.kwargs))
    result = record.func(*args, **kwargs)
    leaves = tree_leaves(result)
    if any(type(o) is int for o in leaves):
        results[index] = leaves
    if record.kind == "mutate" and not any(record.fresh):
        return
    for static, new, fresh in zip(tree_leaves(record.outputs), leaves, record.fresh):
        if fresh and static is not new:
            static.copy_(new)


class _TaskGroup:
    """The handle graph_task_group_end returns: the recorded calls [start, stop) of a graph."""

    def __init__(self, graph: "NPUGraph", start: int, stop: int):
        self.graph, self.start, self.stop = graph, start, stop

    def __repr__(self) -> str:
        return f"<torch.npu graph task group: {self.stop - self.start} recorded call(s)>"


class _GraphDispatchMode:
    """`NPUGraph.graph_dispatch_mode` (torch_npu's auto-dispatch capture state): the stream that
    `NPUGraph.update` issues its task updates on, one for all graphs of the process (created on
    first use), and the graph's recorded calls that `update(cpu_update_input=...)` changes, in
    capture order. (Capture itself is the graph's _CaptureMode, which records every call.)"""

    _update_stream: Optional[torch.Stream] = None

    def __init__(self, graph: "NPUGraph"):
        self._graph = graph

    @property
    def update_stream(self) -> torch.Stream:
        cls = _GraphDispatchMode
        if cls._update_stream is None:
            from .streams import Stream

            with _lock:
                if cls._update_stream is None:
                    cls._update_stream = Stream()
        return cls._update_stream

    @property
    def graph_dispatch_records(self) -> list[_Record]:
        if not self._graph.auto_dispatch_capture:
            return []
        return [r for r in self._graph._records
                if r.kind != "host" and r.func.overloadpacket.__name__ in _UPDATABLE]

    def __repr__(self) -> str:
        n = len(self.graph_dispatch_records)
        return f"<torch.npu graph dispatch mode: {n} updatable call(s)>"


class NPUGraph:
    """A captured sequence of npu work, replayed with `replay()` (torch_npu's NPUGraph)."""

    def __init__(self, keep_graph: bool = False):
        # keep_graph (torch.cuda.CUDAGraph's): whether capture_end instantiates the graph at once
        # or at instantiate() / the first replay; nothing here needs instantiating.
        self.keep_graph = bool(keep_graph)
        self._records: list[_Record] = []
        self._has_graph = False
        self._capturing = False
        self._pool: Optional[tuple[int, int]] = None
        self._stream: Optional[torch.Stream] = None
        self._mode: Optional[_CaptureMode] = None
        self._thread: Optional[int] = None
        self._error: Optional[BaseException] = None
        self._group_start: Optional[int] = None
        self._update: Optional[list] = None
        self._update_group: Optional[_TaskGroup] = None
        self._debug = False
        self.auto_dispatch_capture = False
        self.graph_dispatch_mode = _GraphDispatchMode(self)
        self._rng_reads: list[dict] = []  # generator states read in capture (_rng_state_read)

    # -- capture --------------------------------------------------------------------------------

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        """Begins capturing the npu work of the calling thread on the current stream (which must
        not be the default stream). `pool`: a token from graph_pool_handle() or another graph's
        pool(), which this graph then shares."""
        global _capturing
        if self._has_graph or self._capturing:
            raise RuntimeError("This NPUGraph instance already owns a captured graph. To capture "
                               "a new graph, create a new instance.")
        if capture_error_mode not in _CAPTURE_MODES:
            raise RuntimeError(f"NPUGraph.capture_begin: capture_error_mode must be one of "
                               f"{_CAPTURE_MODES}, but got {capture_error_mode!r}")
        from .streams import current_stream

        stream = current_stream()
        if stream.stream_id == 0:
            raise RuntimeError("NPU graphs must be captured on a non-default stream. (However, "
                               "after capture, it's ok to replay them on the default stream.)")
        self._pool = _checked_pool(pool) if pool is not None else (next(_pool_ids), 0)
        with _lock:
            if _capturing is not None:
                raise RuntimeError(f"{_NOT_PERMITTED}: NPUGraph.capture_begin while another "
                                   f"NPUGraph is capturing (one capture at a time)")
            _capturing = self
        self._records, self._error, self._rng_reads = [], None, []
        self._stream, self._thread, self._capturing = stream, threading.get_ident(), True
        self._mode = _CaptureMode(self)
        self._mode.__enter__()

    def capture_end(self) -> None:
        """Ends the capture begun on the current stream; replay() may then be called."""
        global _capturing
        if not self._capturing:
            raise RuntimeError("capture_end() called before capture_begin().")
        from .streams import current_stream

        stream = current_stream()
        if (stream.stream_id, stream.device_index) != (self._stream.stream_id,
                                                       self._stream.device_index):
            raise RuntimeError("Capture must end on the same stream it began on.")
        self._finish_capture()
        if self._error is not None:
            self._records = []
            raise RuntimeError(f"NPUGraph capture was invalidated by an error during capture: "
                               f"{self._error}") from self._error
        self._has_graph = True

    def _finish_capture(self) -> None:
        global _capturing
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        self._capturing = False
        self._group_start = None
        with _lock:
            if _capturing is self:
                _capturing = None

    def _invalidate(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err

    # -- use ------------------------------------------------------------------------------------

    def instantiate(self) -> None:
        """torch.cuda.CUDAGraph.instantiate: the recorded calls are ready to replay as they are."""
        if not self._has_graph:
            raise RuntimeError("Called NPUGraph::instantiate without a preceding successful "
                               "capture.")

    def replay(self) -> None:
        """Runs the captured work again on the captured tensors (static inputs and outputs)."""
        if not self._has_graph:
            raise RuntimeError("Called NPUGraph::replay without a preceding successful capture.")
        results: dict = {}
        records, index, n = self._records, 0, len(self._records)
        while index < n:
            if records[index].kind == "host":  # user code: called as it was at capture, with
                _run(records[index], index, results)  # autograd and autocast as they are now
                index += 1
                continue
            with _replaying():  # a run of recorded ATen calls
                while index < n and records[index].kind != "host":
                    _run(records[index], index, results)
                    index += 1

    def reset(self) -> None:
        """Deletes the captured graph and releases the tensors it holds (its memory pool)."""
        if self._capturing:
            self._finish_capture()
        self._records, self._rng_reads = [], []
        self._has_graph = False
        self._error = None

    def pool(self) -> tuple[int, int]:
        """A token for another graph's capture_begin / torch.npu.graph(pool=...): share this
        graph's memory pool."""
        if not self._has_graph:
            raise RuntimeError("Called NPUGraph::pool() without a preceding successful capture.")
        return self._pool

    def register_generator_state(self, generator) -> None:
        """torch.cuda.CUDAGraph.register_generator_state: lets the graph's random ops draw from a
        generator other than the default one at each replay. Every generator a recorded op was
        given draws again at replay here, so this checks that `generator` is an npu
        torch.Generator and has nothing else to do."""
        if not isinstance(generator, torch.Generator) or generator.device.type != "npu":
            raise TypeError(f"NPUGraph.register_generator_state: expected an npu "
                            f"torch.Generator, but got {generator!r}")

    def enable_debug_mode(self) -> None:
        """Keeps what debug_dump writes (here every graph keeps it: this only sets the flag)."""
        self._debug = True

    def debug_dump(self, debug_path: str) -> None:
        """Writes the captured graph to `debug_path` as a Chrome trace (a JSON list of events, for
        chrome://tracing or Perfetto; torch_npu's ACL model dump has the same form): one "X"
        event per recorded call, on the track of the stream it was called on ("stream<id>"),
        laid out in capture order with the call's host duration at capture; `args` hold the
        replay kind (compute / mutate / view / alloc) and the tensors' shapes and dtypes. Then,
        as torch_npu does, writes `<name>.aligned.json` beside it with
        `_npugraph_utils.align_trace_json`; if that fails the dump is kept and a warning logged.
        Without a successful capture it warns and writes nothing."""
        if not self._has_graph:
            warnings.warn("Called NPUGraph::debug_dump without a preceding successful capture.")
            return
        events, ts = [], 0.0
        for index, record in enumerate(self._records):
            events.append(record.trace_event(index, ts))
            ts += record.dur_us
        with open(debug_path, "w", encoding="utf-8") as f:
            json.dump(events, f, indent=1)
        from . import _npugraph_utils  # looked up per call: tests patch align_trace_json

        try:
            _npugraph_utils.align_trace_json(debug_path, None)
        except Exception:  # the aligned copy is optional; the dump itself was written
            _log.warning("NPUGraph.debug_dump: could not write the aligned trace of %s",
                         debug_path, exc_info=True)

    def update(self, cpu_update_input) -> None:
        """torch_npu's update of a graph captured with `torch.npu.graph(..., auto_dispatch_capture
        =True)`: `cpu_update_input` holds one dict per recorded call of the ops torch_npu has
        update handlers for (fused infer attention v1/v2, paged attention, MLA, fusion attention
        v3 and its grad), in capture order (a single dict applies to all); each key that names one
        of the op's arguments (e.g. "actual_seq_lengths") replaces that argument for later
        replays."""
        if not self.auto_dispatch_capture:
            raise RuntimeError("The current graph configuration does not support update,"
                               "Try to capture by setting auto_dispatch_capture=True during capture")
        if not self._has_graph:
            raise RuntimeError("Called NPUGraph.update without a preceding successful capture.")
        records = self.graph_dispatch_mode.graph_dispatch_records
        if not isinstance(cpu_update_input, (list, tuple)) or not all(
                isinstance(d, dict) for d in cpu_update_input):
            raise TypeError(f"NPUGraph.update: cpu_update_input must be a list of dicts, but got "
                            f"{cpu_update_input!r}")
        updates = list(cpu_update_input)
        if len(updates) == 1:
            updates = updates * len(records)
        if len(updates) != len(records):
            raise RuntimeError(f"Currently, there are {len(records)} operators that need to be "
                               f"updated by capture, and there are only {len(updates)} elements "
                               f"in the incoming cpu_update_input list")
        for record, update in zip(records, updates):
            names = [a.name for a in record.func._schema.arguments]
            args, kwargs = list(record.args), dict(record.kwargs)
            for key, value in update.items():
                if key not in names:
                    continue
                i = names.index(key)
                if i < len(args) and not record.func._schema.arguments[i].kwarg_only:
                    args[i] = value
                else:
                    kwargs[key] = value
            record.args, record.kwargs = tuple(args), kwargs

    # -- task groups (graph_task_group_* / graph_task_update_*) ---------------------------------

    def _update_call(self, func, args, kwargs):
        group, calls = self._update_group, self._update
        i = len(calls)
        if i >= group.stop - group.start:
            raise RuntimeError(f"graph_task_update: more calls than the task group recorded "
                               f"({group.stop - group.start}); the extra call is {func}")
        record = self._records[group.start + i]
        if record.func is not func:
            raise RuntimeError(f"graph_task_update: call {i} of the task group was {record.func} "
                               f"at capture, but the update calls {func}")
        calls.append((func, args, dict(kwargs)))
        return record.outputs

    def __repr__(self) -> str:
        state = ("capturing" if self._capturing else
                 f"{len(self._records)} recorded calls" if self._has_graph else "empty")
        return f"<torch.npu.NPUGraph {state}>"


def _checked_pool(pool) -> tuple[int, int]:
    if (not isinstance(pool, tuple) or len(pool) != 2
            or not all(isinstance(v, int) for v in pool) or not any(pool)):
        raise TypeError(f"NPUGraph.capture_begin: pool must be a token from "
                        f"torch.npu.graph_pool_handle() or NPUGraph.pool(), but got {pool!r}")
    return pool


def graph_pool_handle() -> tuple[int, int]:
    """An opaque token naming a new graph memory pool, for graphs that should share one."""
    return (0, next(_pool_ids))


def is_current_stream_capturing() -> bool:
    """True while an NPUGraph captures on the current stream of the calling thread."""
    graph = _capturing
    if graph is None or graph._thread != threading.get_ident():
        return False
    from .streams import current_stream

    stream = current_stream(graph._stream.device_index)
    return stream.stream_id == graph._stream.stream_id


def _capturing_graph(stream, what: str) -> NPUGraph:
    graph = _capturing
    if graph is None or graph._thread != threading.get_ident():
        raise RuntimeError(f"torch.npu.{what}: the stream is not capturing (call it inside "
                           f"torch.npu.graph or between capture_begin and capture_end)")
    if stream is not None and not isinstance(stream, torch.Stream):
        raise TypeError(f"torch.npu.{what}: stream must be a torch.npu.Stream, but got {stream!r}")
    return graph


def graph_task_group_begin(stream) -> None:
    """Starts a task group on the capturing `stream`: the calls until graph_task_group_end can be
    replaced later by graph_task_update_begin / _end."""
    graph = _capturing_graph(stream, "graph_task_group_begin")
    if graph._group_start is not None:
        raise RuntimeError("torch.npu.graph_task_group_begin: a task group is already open on "
                           "this capture (call graph_task_group_end first)")
    graph._group_start = len(graph._records)


def graph_task_group_end(stream) -> _TaskGroup:
    """Ends the task group and returns its handle, for graph_task_update_begin."""
    graph = _capturing_graph(stream, "graph_task_group_end")
    if graph._group_start is None:
        raise RuntimeError("torch.npu.graph_task_group_end: no task group is open (call "
                           "graph_task_group_begin first)")
    handle = _TaskGroup(graph, graph._group_start, len(graph._records))
    graph._group_start = None
    return handle


def graph_task_update_begin(stream, handle: _TaskGroup) -> None:
    """Starts replacing the task group `handle`'s recorded calls: the npu calls made until
    graph_task_update_end are not run now; they replace, in order, the group's recorded calls
    (same ops, new arguments, e.g. FIA's actual_seq_lengths) for the following replays, and
    return the outputs the recorded calls return."""
    if not isinstance(handle, _TaskGroup):
        raise TypeError(f"torch.npu.graph_task_update_begin: handle must be what "
                        f"graph_task_group_end returned, but got {handle!r}")
    graph = handle.graph
    if not graph._has_graph:
        raise RuntimeError("torch.npu.graph_task_update_begin: the task group's graph has no "
                           "completed capture (update it after capture_end)")
    if _capturing is not None:
        raise RuntimeError("torch.npu.graph_task_update_begin: not allowed while a graph captures")
    if graph._update is not None:
        raise RuntimeError("torch.npu.graph_task_update_begin: an update of this graph is "
                           "already open (call graph_task_update_end first)")
    graph._update, graph._update_group = [], handle
    graph._mode = _CaptureMode(graph)
    graph._mode.__enter__()


def graph_task_update_end(stream) -> None:
    """Ends the update begun by graph_task_update_begin and applies it."""
    graph = None
    for candidate in _open_updates():
        graph = candidate
    if graph is None:
        raise RuntimeError("torch.npu.graph_task_update_end: no update is open (call "
                           "graph_task_update_begin first)")
    mode, graph._mode = graph._mode, None
    mode.__exit__(None, None, None)
    calls, group = graph._update, graph._update_group
    graph._update = graph._update_group = None
    if len(calls) != group.stop - group.start:
        raise RuntimeError(f"torch.npu.graph_task_update_end: the task group recorded "
                           f"{group.stop - group.start} call(s) but the update made {len(calls)}; "
                           f"the graph is unchanged")
    for i, (func, args, kwargs) in enumerate(calls):
        record = graph._records[group.start + i]
        record.args, record.kwargs = args, kwargs


def _cancel_update(graph: NPUGraph) -> None:
    """Closes `graph`'s open task update without applying it (its calls failed)."""
    mode, graph._mode = graph._mode, None
    if mode is not None:
        mode.__exit__(None, None, None)
    graph._update = graph._update_group = None


def _fused_infer_attention_score_out_graph(stream, handle, event, *args, **kwargs):
    """torch_npu._C._npu_fused_infer_attention_score_out_graph(stream, handle, event, query, key,
    value, *, ..., out=[attention_out, softmax_lse]): one call for a task-group update of a
    captured `npu_fused_infer_attention_score.out`: graph_task_update_begin(stream, handle), the
    op with the new arguments (it replaces the group's recorded call for later replays and does
    not run now), graph_task_update_end(stream), then `event.record(stream)`. Returns the out
    tensors."""
    out = kwargs.pop("out", None)
    if not isinstance(out, (list, tuple)) or len(out) != 2 or not all(
            isinstance(t, torch.Tensor) for t in out):
        raise RuntimeError(f"_npu_fused_infer_attention_score_out_graph: out must have 2 tensors "
                           f"(attention_out, softmax_lse), but got {out!r}")
    if not isinstance(event, ExternalEvent):
        raise TypeError(f"_npu_fused_infer_attention_score_out_graph: event must be a "
                        f"torch.npu.ExternalEvent, but got {event!r}")
    graph_task_update_begin(stream, handle)
    try:
        result = torch.ops.npu.npu_fused_infer_attention_score.out(
            *args, **kwargs, attention_out=out[0], softmax_lse=out[1])
    except BaseException:
        _cancel_update(handle.graph)
        raise
    graph_task_update_end(stream)
    event.record(stream)
    return result


def _open_updates():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, _CaptureMode) and mode.graph._update is not None:
            yield mode.graph


class graph:  # noqa: N801  (torch_npu's name)
    """`with torch.npu.graph(g):` captures the block's npu work into the NPUGraph `g`, on `stream`
    (default: a side stream shared by all graphs), after a synchronisation (torch_npu's and
    torch.cuda's context manager). `auto_dispatch_capture=True` lets `g.update(...)` change the
    recorded attention ops' sequence lengths."""

    default_capture_stream: Optional[torch.Stream] = None

    def __init__(self, npu_graph: NPUGraph, pool=None, stream=None,
                 auto_dispatch_capture: bool = False, capture_error_mode: str = "global"):
        if not isinstance(npu_graph, NPUGraph):
            raise TypeError(f"torch.npu.graph: npu_graph must be a torch.npu.NPUGraph, but got "
                            f"{npu_graph!r}")
        from .streams import Stream, stream as stream_ctx

        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = Stream()
            stream = graph.default_capture_stream
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream
        self.stream_ctx = stream_ctx(stream)
        self.npu_graph = npu_graph
        self.capture_error_mode = capture_error_mode
        npu_graph.auto_dispatch_capture = bool(auto_dispatch_capture)

    def __enter__(self):
        from .device import synchronize

        synchronize()
        self.stream_ctx.__enter__()
        try:
            self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self.stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            if exc_type is None:
                self.npu_graph.capture_end()
            else:  # the block's error propagates, not the invalidated capture's
                with contextlib.suppress(RuntimeError):
                    self.npu_graph.capture_end()
        finally:
            self.stream_ctx.__exit__(exc_type, exc_value, traceback)
        return False


def _launch_host_func(stream, fn: Callable, user_data) -> None:
    """torch_npu.npu._launch_host_func(stream, fn, user_data): calls `fn(user_data)` on the host
    when the work before it on `stream` is done. Work runs in program order on the host, so it
    is called at once; while a graph captures, the call is also recorded as a node of the graph
    and made again, at its place, at every replay (ACL: aclrtLaunchCallback, captured as a host
    task). The npu work `fn` does belongs to the host function, not to the graph: it is not
    recorded, so a replay runs it once, through the function."""
    if not (isinstance(stream, torch.Stream) and stream.device.type == "npu"):
        raise TypeError(f"_launch_host_func: stream must be an npu stream, but got {stream!r}")
    if not callable(fn):
        raise TypeError(f"_launch_host_func: fn must be callable, but got {fn!r}")
    graph = _capturing
    if graph is None or graph._thread != threading.get_ident() or graph._mode is None:
        fn(user_data)
        return
    from torch.utils._python_dispatch import _disable_current_modes

    start = time.perf_counter_ns()
    with _disable_current_modes():
        fn(user_data)
    record = _Record(fn, (user_data,), {}, None, [], "host")
    record.stream, record.device = stream.stream_id, stream.device_index
    record.dur_us = (time.perf_counter_ns() - start) / 1000.0
    graph._records.append(record)


# -- generator state inside a capture (torch.npu.get_rng_state / set_rng_state / manual_seed) ---
#
# As in CUDA graphs, a generator's state read and restored inside a capture is relative to the
# run: `s = get_rng_state(); ...; set_rng_state(s)` rewinds, at every replay, to where that
# replay's generator was when it reached the read (torch.utils.checkpoint(preserve_rng_state=True)
# relies on it). Both calls are recorded as host nodes: the read stores the state the generator
# has at that point of the replay, the restore sets it back. A state not read in this capture is
# set as given, at capture and at each replay; changing the seed during a capture raises, as
# torch_npu's generator does.

_SEED_MISMATCH = ("NPUGeneratorImpl::set_current_seed can be called during stream capture only if "
                  "new seed is the same as the original seed.")


def _capturing_here() -> Optional["NPUGraph"]:
    graph = _capturing
    if graph is None or graph._thread != threading.get_ident() or graph._mode is None:
        return None
    return graph


def _record_host_call(graph: "NPUGraph", fn: Callable, arg, name: str) -> None:
    record = _Record(fn, (arg,), {}, None, [], "host")
    stream = graph._stream
    record.stream, record.device = stream.stream_id, stream.device_index
    fn.__qualname__ = name
    graph._records.append(record)


def _state_seed(state: torch.Tensor) -> int:
    engine = torch.Generator()  # the npu state is the CPU engine's, then an 8-byte offset
    engine.set_state(state[:-8].clone())
    return engine.initial_seed()


def _rng_state_read(generator: torch.Generator, state: torch.Tensor) -> None:
    """get_rng_state during a capture: a node that notes the generator's state at this point of
    each replay."""
    graph = _capturing_here()
    if graph is None:
        return
    slot = {"capture": state.clone(), "replay": state.clone()}
    graph._rng_reads.append(slot)

    def read(_):
        slot["replay"] = generator.get_state()

    _record_host_call(graph, read, None, "get_rng_state")


def _rng_state_write(generator: torch.Generator, state: torch.Tensor) -> None:
    """set_rng_state during a capture: checked, then recorded (see above); the caller sets it."""
    graph = _capturing_here()
    if graph is None:
        return
    for slot in reversed(graph._rng_reads):
        if torch.equal(slot["capture"], state):
            def restore(_, slot=slot):
                generator.set_state(slot["replay"])

            _record_host_call(graph, restore, None, "set_rng_state")
            return
    if _state_seed(state) != generator.initial_seed():
        err = RuntimeError(_SEED_MISMATCH)
        graph._invalidate(err)
        raise err
    fixed = state.clone()

    def write(_):
        generator.set_state(fixed)

    _record_host_call(graph, write, None, "set_rng_state")


def _rng_seed_write(generator: torch.Generator, seed: int) -> None:
    """manual_seed during a capture: the same seed is accepted (and does nothing to the graph: the
    replay draws from the generator as it is then); another raises."""
    graph = _capturing_here()
    if graph is not None and int(seed) != generator.initial_seed():
        err = RuntimeError(_SEED_MISMATCH)
        graph._invalidate(err)
        raise err


def _checked_report_stream(stream, what: str) -> None:
    if not (isinstance(stream, torch.Stream) and stream.device.type == "npu"):
        raise TypeError(f"{what}: stream must be an npu stream, but got {stream!r}")


def _subscribe_report(stream) -> None:
    """torch_npu.npu._subscribe_report(stream): on Ascend, starts the thread that runs the host
    functions launched on `stream`. Host functions run in the launching thread here (at once,
    or at replay), so this checks the stream and has nothing to start."""
    _checked_report_stream(stream, "_subscribe_report")


def _unsubscribe_report(stream) -> None:
    """torch_npu.npu._unsubscribe_report(stream): on Ascend, waits for `stream`'s host functions
    and stops delivering them; every host function has already run here."""
    _checked_report_stream(stream, "_unsubscribe_report")


class ExternalEvent:
    """torch_npu's ExternalEvent (an event that may be waited on before it is recorded, captured
    as an external node). Work runs in program order on the host, so record, wait and reset have
    nothing to order: they check their stream and return."""

    def record(self, stream=None) -> None:
        _checked_stream(stream, "record")

    def wait(self, stream=None) -> None:
        _checked_stream(stream, "wait")

    def reset(self, stream=None) -> None:
        _checked_stream(stream, "reset")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _check_not_capturing("ExternalEvent.synchronize()")

    def __repr__(self) -> str:
        return "<torch_npu.npu.ExternalEvent>"


def _checked_stream(stream, what: str) -> None:
    if stream is not None and not (isinstance(stream, torch.Stream) and stream.device.type == "npu"):
        raise TypeError(f"ExternalEvent.{what}: stream must be an npu stream, but got {stream!r}")


def make_graphed_callables(callables, sample_args, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, pool=None):
    """torch.cuda.make_graphed_callables for npu: each callable (a function or nn.Module) runs its
    forward as a replay of a captured forward graph inside one autograd node, whose backward
    replays a captured backward graph. Arguments are passed as in `sample_args` (tensors only);
    module parameters are static inputs; modules must have no hooks when passed."""
    if torch.is_autocast_enabled("npu") and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables does not support the autocast caching. Please "
                           "set `cache_enabled=False`.")
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    if len(callables) != len(sample_args):
        raise ValueError(f"make_graphed_callables: {len(callables)} callables but "
                         f"{len(sample_args)} sample_args")
    flat_args = []
    for fn, args in zip(callables, sample_args):
        if isinstance(fn, torch.nn.Module):
            if fn._backward_hooks or fn._forward_hooks or fn._forward_pre_hooks:
                raise RuntimeError("Modules must not have hooks registered at the time they are "
                                   "passed. However, registering hooks on modules after passing "
                                   "them through make_graphed_callables is allowed.")
            if any(b.requires_grad for b in fn.buffers()):
                raise RuntimeError("In any nn.Module passed to make_graphed_callables, only "
                                   "parameters may be trainable. All buffers must have "
                                   "requires_grad=False.")
        leaves = tuple(torch.utils._pytree.arg_tree_leaves(*args))
        if not all(isinstance(a, torch.Tensor) for a in leaves):
            raise RuntimeError("In the beta API, sample_args for each callable must contain only "
                               "Tensors. Other types are not allowed.")
        flat_args.append(leaves)

    params = [tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else () for fn in callables]
    surfaces = [a + p for a, p in zip(flat_args, params)]
    fwd_graphs = [NPUGraph() for _ in callables]
    bwd_graphs = [NPUGraph() for _ in callables]
    mempool = graph_pool_handle() if pool is None else pool

    from .device import synchronize
    from .streams import Stream, stream as stream_ctx

    synchronize()
    with stream_ctx(Stream()):  # warm-up, outside any capture
        for fn, args, surface in zip(callables, sample_args, surfaces):
            for _ in range(num_warmup_iters):
                outs = tree_leaves(fn(*args))
                needs = tuple(o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)
                if needs:
                    torch.autograd.grad(needs, tuple(i for i in surface if i.requires_grad),
                                        grad_outputs=tuple(torch.empty_like(o) for o in needs),
                                        only_inputs=True, allow_unused=allow_unused_input)
    synchronize()

    static_outs, specs = [], []
    for fn, args, g in zip(callables, sample_args, fwd_graphs):
        with graph(g, pool=mempool):
            out = fn(*args)
        flat, spec = tree_flatten(out)
        static_outs.append(tuple(flat))
        specs.append(spec)

    grad_outs, grad_ins = [None] * len(callables), [None] * len(callables)
    for i in reversed(range(len(callables))):  # backward captures in reverse order, as they run
        surface, outs = surfaces[i], static_outs[i]
        g_outs = tuple(torch.empty_like(o) if o.requires_grad else None for o in outs)
        needs = tuple(o for o in outs if o.requires_grad)
        grads = None
        if needs:
            with graph(bwd_graphs[i], pool=mempool):
                grads = torch.autograd.grad(needs, tuple(x for x in surface if x.requires_grad),
                                            grad_outputs=tuple(g for g in g_outs if g is not None),
                                            only_inputs=True, allow_unused=allow_unused_input)
        grads_iter = iter(grads or ())
        grad_ins[i] = tuple(next(grads_iter) if (x.requires_grad and grads is not None) else None
                            for x in surface)
        grad_outs[i] = g_outs

    result = []
    for i, fn in enumerate(callables):
        graphed = _graphed_function(fwd_graphs[i], bwd_graphs[i], params[i], len(flat_args[i]),
                                    specs[i], surfaces[i], static_outs[i], grad_outs[i],
                                    grad_ins[i])
        if isinstance(fn, torch.nn.Module):
            fn.forward = _graphed_forward(fn, fn.training, graphed, fn.forward)
            result.append(fn)
        else:
            result.append(graphed)
    return result[0] if single else tuple(result)


def _graphed_function(fwd_graph, bwd_graph, params, n_user, spec, surface, static_outs,
                      static_grad_outs, static_grad_ins) -> Callable:
    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for static, given in zip(surface[:n_user], inputs[:n_user]):
                if static.data_ptr() != given.data_ptr():
                    static.copy_(given)
            fwd_graph.replay()
            return tuple(o.detach() for o in static_outs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            for static, grad in zip(static_grad_outs, grads):
                if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)
            bwd_graph.replay()
            return tuple(g.detach() if g is not None else None for g in static_grad_ins)

    def functionalized(*user_args):
        flat = tuple(torch.utils._pytree.arg_tree_leaves(*user_args))
        if len(flat) != n_user:
            raise RuntimeError(f"graphed callable: expected {n_user} tensor arguments (as in its "
                               f"sample_args), but got {len(flat)}")
        return tree_unflatten(list(Graphed.apply(*(flat + params))), spec)

    return functionalized


def _graphed_forward(module, training: bool, graphed: Callable, eager: Callable) -> Callable:
    def forward(*user_args):
        # the graph holds the training-or-eval behaviour it was captured with
        return graphed(*user_args) if module.training == training else eager(*user_args)

    return forward
