"""Run-time GPU-to-NPU migration: the patches behind ``from torch_npu.contrib import transfer_to_npu``.

After :func:`apply`, code written for CUDA runs on the npu device unchanged:

* ``torch.cuda.*`` is the ``torch.npu`` API (device, streams, events, memory, random, amp, legacy
  tensor types); ``torch.cuda.amp`` and its submodules hold torch.npu.amp's names;
* a device argument naming CUDA (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 1)``, a dict
  ``map_location``) given to a factory function, ``Tensor.to``/``new_*``/``pin_memory``,
  ``Module.to``, ``torch.load``, ``torch.autocast``, ``torch.Generator``, ``torch.Event``,
  ``with torch.device("cuda")``, ``torch.set_default_device`` ... is rewritten to the npu device;
  ``Tensor.cuda``/``Module.cuda`` are ``.npu``, ``Tensor.is_cuda`` is ``is_npu``;
* ``torch.distributed``'s ``nccl`` is ``hccl`` (``init_process_group``, ``new_group``,
  ``is_nccl_available``, ``ProcessGroupNCCL``), DDP/FSDP/DeviceMesh/PipelineStage device
  arguments are rewritten;
* ``torch.jit.script`` is the identity (scripted code would bypass the rewriting), Triton is
  reported absent, ``torch._utils._get_available_device_type()`` is ``"npu"``.

The rewriting rules are Ascend's (docs/migration.md): keyword arguments ``device``,
``device_type``, ``map_location`` and ``device_id`` also turn an ``int`` ``i`` into ``"npu:i"``;
positional ints are rewritten only for ``to``/``to_empty`` (so ``a.to(0)`` moves to npu:0 while
DDP's ``device_ids=[0]`` stay ints). Unlike Ascend, a string is rewritten only when it is a device
name (``cuda`` or ``cuda:N``), so paths such as ``torch.load("cuda_ckpt.pt")`` are left alone.

``TORCH_NPU_MIGRATION_LOG=<path>`` (read by :func:`apply`) records every rewrite once per call site
in a CSV with msFmkTransplt's ``change_list.csv`` columns. Every patch is recorded, so
:func:`_unpatch` restores PyTorch exactly (for tests).
"""

from __future__ import annotations

import csv
import dis
import functools
import importlib
import importlib.abc
import importlib.metadata
import json
import os
import re
import sys
import threading
import types
import warnings
from typing import Any, Callable

import torch

__all__ = ["apply", "enable_from_env", "is_applied"]

# --------------------------------------------------------------------------------------------
# What is patched (Ascend's lists, docs/migration.md §2.2)

# torch.<name> whose device arguments are rewritten.
TORCH_FUNCTIONS = (
    "logspace", "randint", "hann_window", "rand", "full_like", "ones_like", "rand_like", "randperm",
    "arange", "frombuffer", "normal", "_empty_per_channel_affine_quantized", "empty_strided",
    "empty_like", "scalar_tensor", "tril_indices", "bartlett_window", "ones", "sparse_coo_tensor",
    "randn", "kaiser_window", "tensor", "triu_indices", "as_tensor", "zeros", "randint_like", "full",
    "eye", "_sparse_csr_tensor_unsafe", "empty", "_sparse_coo_tensor_unsafe", "blackman_window",
    "zeros_like", "range", "sparse_csr_tensor", "randn_like", "from_file",
    "_cudnn_init_dropout_state", "_empty_affine_quantized", "linspace", "hamming_window",
    "empty_quantized", "_pin_memory", "load", "set_default_device", "get_device_module",
    "sparse_compressed_tensor",
)
TENSOR_METHODS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor",
                  "new_zeros", "to", "pin_memory")
MODULE_METHODS = ("to", "to_empty")
# torch.cuda.<name> (= torch.npu.<name>) whose device arguments are rewritten.
CUDA_FUNCTIONS = (
    "get_device_properties", "get_device_name", "get_device_capability", "list_gpu_processes",
    "set_device", "synchronize", "mem_get_info", "memory_stats", "memory_summary",
    "memory_allocated", "max_memory_allocated", "reset_max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "reset_max_memory_cached", "reset_peak_memory_stats", "default_stream",
    "can_device_access_peer", "current_stream", "utilization", "set_per_process_memory_fraction",
    "caching_allocator_alloc",
)
# torch.cuda's random functions that take a device.
_RANDOM_FUNCTIONS = ("get_rng_state", "set_rng_state")
# Keyword arguments that name a device; an int among them means "npu:<int>".
DEVICE_KWARGS = ("device", "device_type", "map_location", "device_id")
# Functions whose positional ints are device indices.
_INT_POSITIONAL = frozenset(("to", "to_empty"))

_NATIVE_NPU_APIS = os.path.join(os.path.dirname(__file__), "native_npu_apis.json")

# --------------------------------------------------------------------------------------------
# Device rewriting

_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")
_NPU = torch.device("npu")


def _npu_device(value: Any, ints: bool) -> Any:
    """`value` with a CUDA device it names replaced by the npu device of the same index; `value`
    itself (the same object) when it names none. Strings are rewritten only when they are a device
    name ("cuda", "cuda:1"); a dict (map_location) has its values rewritten and its CUDA keys
    doubled by npu ones."""
    kind = type(value)
    if kind is str:
        if _CUDA_DEVICE.fullmatch(value):
            return "npu" + value[4:]
    elif kind is torch.device:
        if value.type == "cuda":
            return _NPU if value.index is None else torch.device("npu", value.index)
    elif kind is int:
        if ints:
            return f"npu:{value}"
    elif kind is dict:
        # map_location: values become npu devices; a key naming CUDA stays (a checkpoint saved on
        # a GPU has "cuda:N" locations) and gets its npu twin (one saved under transfer_to_npu).
        changed = False
        new = {}
        for k, v in value.items():
            v2 = _npu_device(v, False)
            changed = changed or v2 is not v
            new[k] = v2
        for k in value:
            k2 = _npu_device(k, False)
            if k2 is not k and k2 not in value:
                new[k2] = new[k]
                changed = True
        if changed:
            return new
    elif isinstance(value, str) and _CUDA_DEVICE.fullmatch(value):  # str subclasses
        return "npu" + value[4:]
    return value


def _rewrite_call(args: tuple, kwargs: dict, ints: bool, where: str):
    """(args, kwargs) of a call to `where` with CUDA devices replaced (module docstring: the
    rules); the given objects themselves when nothing names CUDA."""
    new_args = None
    for i, arg in enumerate(args):
        new = _npu_device(arg, ints)
        if new is not arg:
            if new_args is None:
                new_args = list(args)
            new_args[i] = new
            if _log is not None:
                _log.record(f"change device {_show(arg)} of {where} to {_show(new)}")
    if kwargs:
        for name in DEVICE_KWARGS:
            value = kwargs.get(name)
            if value is not None:
                new = _npu_device(value, True)
                if new is not value:
                    kwargs[name] = new
                    if _log is not None:
                        _log.record(f"change argument {name} of {where} from {_show(value)} to "
                                    f"{_show(new)}")
        ids = kwargs.get("device_ids")
        if type(ids) in (list, tuple):
            new_ids = [_npu_device(d, ints) for d in ids]
            if any(a is not b for a, b in zip(ids, new_ids)):
                kwargs["device_ids"] = type(ids)(new_ids)
                if _log is not None:
                    _log.record(f"change argument device_ids of {where} from {_show(ids)} to "
                                f"{_show(kwargs['device_ids'])}")
    return (args if new_args is None else tuple(new_args)), kwargs


def _show(value: Any) -> str:
    return repr(str(value)) if isinstance(value, torch.device) else repr(value)


def _with_device_rewrite(fn: Callable, where: str, ints: bool | None = None) -> Callable:
    """`fn` with its CUDA device arguments rewritten; positional ints are devices when `ints`
    (default: when fn is named `to` or `to_empty`)."""
    if ints is None:
        ints = getattr(fn, "__name__", "") in _INT_POSITIONAL

    @functools.wraps(fn)
    def rewritten(*args, **kwargs):
        args, kwargs = _rewrite_call(args, kwargs, ints, where)
        return fn(*args, **kwargs)

    rewritten._opennpu_original = fn
    return rewritten


_BACKEND_SPEC = re.compile(r"(\w+:)?\w+(,(\w+:)?\w+)*")


def _hccl_backend(value: Any) -> Any:
    """A backend string ("nccl", "cpu:gloo,cuda:nccl") with nccl -> hccl and cuda -> npu."""
    if isinstance(value, str) and _BACKEND_SPEC.fullmatch(value) and ("nccl" in value or "cuda" in value):
        return re.sub(r"\bcuda\b", "npu", value.replace("nccl", "hccl"))
    return value


def _with_hccl_backend(fn: Callable, where: str) -> Callable:
    """`fn` with a backend naming nccl (keyword `backend` or a positional backend string) given
    hccl instead."""

    @functools.wraps(fn)
    def hccl(*args, **kwargs):
        if args:
            new = tuple(_hccl_backend(a) for a in args)
            for old, changed in zip(args, new):
                if changed is not old and _log is not None:
                    _log.record(f"change backend of {where} from {old!r} to {changed!r}")
            args = new
        backend = kwargs.get("backend")
        if backend is not None:
            changed = _hccl_backend(backend)
            if changed is not backend:
                kwargs["backend"] = changed
                if _log is not None:
                    _log.record(f"change backend of {where} from {backend!r} to {changed!r}")
        return fn(*args, **kwargs)

    hccl._opennpu_original = fn
    return hccl


# Ascend's private names for the rewriting helpers (its tests call them).
def _wrapper_cuda(fn: Callable) -> Callable:
    return _with_device_rewrite(fn, getattr(fn, "__qualname__", repr(fn)))


def _wrapper_hccl(fn: Callable) -> Callable:
    return _with_hccl_backend(fn, getattr(fn, "__qualname__", repr(fn)))


def _replace_cuda_to_npu_in_dict(device_dict: dict) -> dict:
    return _npu_device(dict(device_dict), False)


# --------------------------------------------------------------------------------------------
# The migration log

class _MigrationLog:
    """Rows of msFmkTransplt's change_list.csv, one per (call site, message): the call site is the
    innermost frame outside torch and opennpu, its lines those of the call expression. Rows are
    appended and flushed as they come, so several processes can share a file and a crash loses
    nothing."""

    HEADER = ["File", "Start Line", "End Line", "Operation Type", "Message"]

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.seen: set[tuple[str, int, str]] = set()
        self.lock = threading.Lock()
        self.file = open(self.path, "a", newline="", encoding="utf-8")
        self.writer = csv.writer(self.file)
        if self.file.tell() == 0:
            self.writer.writerow(self.HEADER)
            self.file.flush()

    def record(self, message: str) -> None:
        if torch.compiler.is_compiling():  # traced: the eager run logged the call site
            return
        frame = _call_site(sys._getframe(1))
        if frame is None:
            filename, start, end = "<unknown>", 0, 0
        else:
            filename, start, end = frame.f_code.co_filename, frame.f_lineno, frame.f_lineno
        key = (filename, start, message)
        if key in self.seen:
            return
        with self.lock:
            if key in self.seen:
                return
            self.seen.add(key)
            if frame is not None:
                start, end = _call_lines(frame)
            self.writer.writerow([filename, start, end, "MODIFY", message])
            self.file.flush()

    def close(self) -> None:
        self.file.close()


_INTERNAL_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                  os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def _call_site(frame):
    """The innermost frame of user code: the first caller outside torch, opennpu, importlib and
    code generated by torch.fx (a compiled graph is attributed to the call that ran it)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_INTERNAL_DIRS) and not name.startswith(("<frozen", "<eval_with_key>")):
            return frame
        frame = frame.f_back
    return None


def _call_lines(frame) -> tuple[int, int]:
    """First and last line of the expression `frame` is executing (a call may span lines)."""
    current = None
    try:
        for instruction in dis.get_instructions(frame.f_code):
            if instruction.offset > frame.f_lasti:
                break
            current = instruction
    except (AttributeError, ValueError):
        pass
    positions = getattr(current, "positions", None)  # Python >= 3.11
    if positions is None or not current.opname.startswith("CALL") or positions.lineno is None:
        return frame.f_lineno, frame.f_lineno  # e.g. a `with` statement: its first line
    start, end = positions.lineno, positions.end_lineno
    start = start or frame.f_lineno
    return start, max(end or start, start)


_log: _MigrationLog | None = None


def _logged(fn: Callable, message: str) -> Callable:
    """`fn` (a function or a class) recording `message` at each new call site. A class becomes a
    subclass whose metaclass records the instantiation, so isinstance checks keep working."""
    if isinstance(fn, type):
        meta = type(fn)

        def call(cls, *args, **kwargs):
            _log.record(message)
            return meta.__call__(cls, *args, **kwargs)

        bases = (meta,) if issubclass(meta, _KeepsBaseInstances) else (_KeepsBaseInstances, meta)
        logged_meta = type(f"_Logged{meta.__name__}", bases, {"__call__": call})
        return logged_meta(fn.__name__, (fn,), {"__module__": fn.__module__,
                                                "__qualname__": fn.__qualname__,
                                                "__doc__": fn.__doc__})

    @functools.wraps(fn)
    def logged(*args, **kwargs):
        _log.record(message)
        return fn(*args, **kwargs)

    logged._opennpu_original = fn
    return logged


# --------------------------------------------------------------------------------------------
# Patch bookkeeping: every change is recorded so that _unpatch() restores PyTorch exactly.

_MISSING = object()
_undo: list[Callable[[], None]] = []


def _set(owner: Any, name: str, value: Any) -> None:
    """setattr(owner, name, value), remembering what owner itself held (inherited attributes are
    restored by deleting the override)."""
    own = vars(owner).get(name, _MISSING)

    def undo():
        if own is _MISSING:
            try:
                delattr(owner, name)
            except AttributeError:
                pass
        else:
            setattr(owner, name, own)

    setattr(owner, name, value)
    _undo.append(undo)


def _pop_item(mapping: dict, key: Any) -> None:
    if key in mapping:
        value = mapping.pop(key)
        _undo.append(lambda: mapping.__setitem__(key, value))


def _wrap(owner: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
    fn = getattr(owner, name, None)
    if fn is not None:
        _set(owner, name, wrapper(fn))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs patches for a module when it is first imported (for modules that are costly to import
    eagerly and that scripts import after transfer_to_npu: FSDP, pipelining, cpp_extension)."""

    def __init__(self):
        self.pending: dict[str, list[Callable[[types.ModuleType], None]]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        hooks = self.pending.pop(fullname)
        run = loader.exec_module

        def exec_module(module):
            run(module)
            for hook in hooks:
                hook(module)

        # The loader object is this module's own (finders make one per spec): it stays the
        # module's __loader__ (inspect.getsource and reload keep working).
        loader.exec_module = exec_module
        return spec


_after_import = _AfterImport()


def _when_imported(name: str, patch: Callable[[types.ModuleType], None]) -> None:
    """patch(module) now if `name` is loaded, else right after its first import."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
        return
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
        _undo.append(lambda: sys.meta_path.remove(_after_import) if _after_import in sys.meta_path else None)
    _after_import.pending.setdefault(name, []).append(patch)
    _undo.append(lambda: _after_import.pending.pop(name, None))


def _replace_everywhere(source: types.ModuleType, name: str, replacement: Callable) -> None:
    """source.name = replacement, and in every loaded torch module that imported the original
    under the same name."""
    original = vars(source).get(name)
    if original is None:
        return
    for module_name, module in list(sys.modules.items()):
        if (module_name.startswith("torch.") and isinstance(module, types.ModuleType)
                and vars(module).get(name) is original):
            _set(module, name, replacement)


# --------------------------------------------------------------------------------------------
# Replacement objects

class _KeepsBaseInstances(type):
    """Metaclass of the stand-in subclasses (torch.Generator, torch.Event, torch.cuda.Stream ...,
    and the logged classes): objects of the class they stand in for (made by C++, by torch.npu or
    before the patch) pass isinstance and issubclass checks against the stand-in."""

    def __instancecheck__(cls, instance):
        return type.__instancecheck__(cls, instance) or isinstance(instance, cls.__bases__[0])

    def __subclasscheck__(cls, subclass):
        return type.__subclasscheck__(cls, subclass) or issubclass(subclass, cls.__bases__[0])


class _Generator(torch.Generator, metaclass=_KeepsBaseInstances):
    """torch.Generator with a CUDA device read as npu."""

    def __new__(cls, device="cpu"):
        _, kwargs = _rewrite_call((), {"device": device}, False, "torch.Generator")
        return super().__new__(cls, kwargs["device"])


class _Event(torch.Event, metaclass=_KeepsBaseInstances):
    """torch.Event with a CUDA device read as npu."""

    def __new__(cls, *args, **kwargs):
        args, kwargs = _rewrite_call(args, kwargs, False, "torch.Event")
        return super().__new__(cls, *args, **kwargs)


def _is_hccl_available() -> bool:
    """Whether torch.distributed has the hccl backend (opennpu registers it)."""
    return torch.distributed.is_available() and "hccl" in torch.distributed.Backend.backend_list


def _has_triton() -> bool:
    return False


def _gpu_type() -> str:
    return "npu"


def _available_device_type() -> str | None:
    return "npu" if torch.npu.is_available() else None


def _jit_script(obj, *args, **kwargs):
    """torch.jit.script under transfer_to_npu: `obj` itself, run by Python (where the device
    rewriting applies) instead of TorchScript."""
    return obj


def _jit_script_method(fn):
    return fn


# --------------------------------------------------------------------------------------------
# Third-party libraries with their own npu path (transformers, accelerate, ...): while one of
# the functions listed in native_npu_apis.json runs, torch.cuda.is_available is PyTorch's own,
# so the library takes its npu branch instead of its CUDA one.

_real_cuda_is_available = torch.cuda.is_available


def _wrapper_libraries_func(fn: Callable) -> Callable:
    """`fn` run with PyTorch's own torch.cuda.is_available (not thread-safe: the attribute is
    swapped for the duration of the call)."""

    @functools.wraps(fn)
    def native(*args, **kwargs):
        patched = torch.cuda.is_available
        torch.cuda.is_available = _real_cuda_is_available
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.is_available = patched

    return native


def _check_input_file_valid(path: str) -> bool:
    """Whether `path` is a readable regular file to trust as configuration: not a symbolic link,
    a name of at most 200 characters, at most 10 MiB."""
    if os.path.islink(os.path.abspath(path)):
        return False
    real = os.path.realpath(path)
    return (os.path.exists(real) and os.access(real, os.R_OK)
            and len(os.path.basename(real)) <= 200 and os.path.getsize(real) <= 10 * 1024 ** 2)


def _load_json_file(path: str, check: Callable[[str], bool] = _check_input_file_valid) -> dict:
    """The JSON object in `path`, or {} when check(path) fails or the file holds no object."""
    if not check(path):
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _patch_native_npu_libraries(table: dict) -> None:
    for package, entry in table.items():
        if not isinstance(entry, dict):
            continue
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if _version_tuple(installed) < _version_tuple(entry.get("min_version", "0")):
            continue
        for qualname in entry.get("functions", []):
            module_name, _, name = qualname.rpartition(".")
            _when_imported(module_name, lambda m, name=name: _wrap(m, name, _wrapper_libraries_func))
        for qualname in entry.get("methods", []):
            module_name, cls_name, name = qualname.rsplit(".", 2)
            _when_imported(module_name, lambda m, c=cls_name, name=name:
                           _wrap(getattr(m, c), name, _wrapper_libraries_func) if hasattr(m, c) else None)


def _del_nccl_device_backend_map() -> None:
    """Removes cuda's default backend (nccl) so init_process_group() picks hccl for npu."""
    mapping = getattr(torch.distributed.Backend, "default_device_backend_map", None)
    if isinstance(mapping, dict):
        _pop_item(mapping, "cuda")


# --------------------------------------------------------------------------------------------
# Applying the patches

_applied = False
_apply_lock = threading.Lock()


def is_applied() -> bool:
    return _applied


def _redirect(dst: types.ModuleType, src: types.ModuleType, names, dst_name: str, src_name: str,
              device_functions=()) -> None:
    """dst.<name> = src.<name> for each name (not submodules); device_functions get their CUDA
    device arguments rewritten; with the log on, each records its redirection."""
    for name in names:
        value = getattr(src, name, None)
        if value is None or isinstance(value, types.ModuleType):
            continue
        if name in device_functions:
            value = _with_device_rewrite(value, f"{dst_name}.{name}", ints=False)
        elif name in _DEVICE_CLASSES and isinstance(value, type):
            value = _device_class(value, f"{dst_name}.{name}")
        if _log is not None and callable(value):
            kind = "class" if isinstance(value, type) else "function"
            value = _logged(value, f"change {kind} {dst_name}.{name} to {src_name}.{name}")
        _set(dst, name, value)


# torch.npu classes whose constructors take a device.
_DEVICE_CLASSES = ("device", "Stream", "ExternalStream")


def _device_class(cls: type, qualname: str) -> type:
    """A subclass of `cls` whose constructor rewrites CUDA devices; objects of `cls` itself pass
    isinstance checks against it (torch.cuda.current_stream() returns a torch.npu.Stream)."""
    ns = {"__module__": qualname.rpartition(".")[0], "__qualname__": cls.__qualname__,
          "__doc__": cls.__doc__}
    if cls.__new__ is not object.__new__:
        def __new__(sub, *args, **kwargs):
            args, kwargs = _rewrite_call(args, kwargs, False, qualname)
            return cls.__new__(sub, *args, **kwargs)
        ns["__new__"] = __new__
    else:
        ns["__init__"] = _with_device_rewrite(cls.__init__, qualname, ints=False)
    return _KeepsBaseInstances(cls.__name__, (cls,), ns)


def _patch_cuda() -> None:
    npu = torch.npu
    npu_amp = npu.amp
    _redirect(torch.cuda, npu, npu.__all__, "torch.cuda", "torch.npu",
              CUDA_FUNCTIONS + _RANDOM_FUNCTIONS)
    _redirect(torch.cuda.amp, npu_amp, npu_amp.__all__, "torch.cuda.amp", "torch.npu.amp")
    for sub in ("autocast_mode", "grad_scaler", "common"):
        npu_sub = getattr(npu_amp, sub, None)
        cuda_sub = sys.modules.get(f"torch.cuda.amp.{sub}")
        if npu_sub is None:
            continue
        if cuda_sub is not None:
            _redirect(cuda_sub, npu_sub, getattr(npu_sub, "__all__", ()), f"torch.cuda.amp.{sub}",
                      f"torch.npu.amp.{sub}")
        _set(torch.cuda.amp, sub, npu_sub)
    _redirect(torch.cuda.random, npu.random, npu.random.__all__, "torch.cuda.random",
              "torch.npu.random", _RANDOM_FUNCTIONS)
    _redirect(torch.cuda.memory, npu.memory, npu.memory.__all__, "torch.cuda.memory",
              "torch.npu.memory", CUDA_FUNCTIONS)


def _unavailable(qualname: str, npu_name: str) -> Callable:
    """A stand-in for a CUDA API the npu device lacks: raises a RuntimeError that says so (instead
    of CUDA's driver or NVML error)."""
    from opennpu.npu._not_provided import REASONS

    reason = REASONS.get(npu_name, "opennpu has no npu counterpart")

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{qualname} has no npu counterpart under transfer_to_npu: "
                           f"torch.npu.{npu_name} is not provided by opennpu ({reason})")

    unavailable.__name__ = unavailable.__qualname__ = qualname.rpartition(".")[2]
    return unavailable


# CUDA APIs without an npu counterpart in opennpu: name in torch.cuda (or a submodule) -> torch_npu's name.
_CUDA_ONLY = {
    "utilization": "utilization",
    "MemPool": "MemPool", "use_mem_pool": "use_mem_pool", "ipc_collect": "ipc_collect",
    "memory._record_memory_history": "memory._record_memory_history",
    "memory._snapshot": "memory._snapshot", "memory._dump_snapshot": "memory._dump_snapshot",
}


def _restore_location(storage, location: str):
    """torch.serialization.default_restore_location under transfer_to_npu: storages a checkpoint
    saved on a CUDA device ("cuda:N") are restored on npu:N (every map_location form ends here
    for the locations it does not map)."""
    if location.startswith("cuda"):
        new = _npu_device(location, False)
        if new is not location:
            if _log is not None:
                _log.record(f"change storage location {location!r} of torch.load to {new!r}")
            location = new
    return _default_restore_location(storage, location)


_default_restore_location = None


def _patch_serialization() -> None:
    global _default_restore_location
    serialization = importlib.import_module("torch.serialization")
    _default_restore_location = serialization.default_restore_location
    _set(serialization, "default_restore_location", _restore_location)


# torch.cuda's graph capture -> torch.npu's (torch.cuda.graphs holds them too).
_GRAPH_NAMES = {"CUDAGraph": "NPUGraph", "graph": "graph", "graph_pool_handle": "graph_pool_handle",
                "make_graphed_callables": "make_graphed_callables",
                "is_current_stream_capturing": "is_current_stream_capturing"}


def _patch_cuda_only() -> None:
    graphs = sys.modules.get("torch.cuda.graphs")
    for name, npu_name in _GRAPH_NAMES.items():
        for owner in (torch.cuda, graphs):
            if owner is not None and hasattr(owner, name):
                _set(owner, name, getattr(torch.npu, npu_name))
    # torch._C._host_emptyCache (CUDA's pinned-memory cache) releases the npu one instead.
    _set(torch._C, "_host_emptyCache", torch.npu.host_empty_cache)
    for name, npu_name in _CUDA_ONLY.items():
        owner_name, _, attr = ("torch.cuda." + name).rpartition(".")
        owner = sys.modules.get(owner_name)
        if owner is not None and hasattr(owner, attr) and not hasattr(torch.npu, npu_name):
            _set(owner, attr, _unavailable(f"{owner_name}.{attr}", npu_name))


def _patch_tensors_and_modules() -> None:
    # `with torch.device(...)` recognises factory functions by identity in this cached set: it
    # must hold PyTorch's functions, which are what __torch_function__ receives.
    torch.utils._device._device_constructors()
    for name in TORCH_FUNCTIONS:
        _wrap(torch, name, lambda fn, name=name: _with_device_rewrite(fn, f"torch.{name}"))
    for name in TENSOR_METHODS:
        _wrap(torch.Tensor, name, lambda fn, name=name: _with_device_rewrite(fn, f"torch.Tensor.{name}"))
    for name in MODULE_METHODS:
        _wrap(torch.nn.Module, name, lambda fn, name=name: _with_device_rewrite(fn, f"torch.nn.Module.{name}"))
    for owner, where in ((torch.Tensor, "torch.Tensor"), (torch.nn.Module, "torch.nn.Module")):
        cuda = _with_device_rewrite(owner.npu, f"{where}.cuda", ints=False)
        if _log is not None:
            cuda = _logged(cuda, f"change function {where}.cuda to {where}.npu")
        _set(owner, "cuda", cuda)
    is_npu = torch.Tensor.is_npu
    if _log is not None:
        def is_cuda(self):
            _log.record("change attribute torch.Tensor.is_cuda to torch.Tensor.is_npu")
            return self.is_npu
        is_npu = property(is_cuda)
    _set(torch.Tensor, "is_cuda", is_npu)
    _set(torch.storage.TypedStorage, "is_cuda", torch.storage.TypedStorage.is_npu)
    _wrap(torch.UntypedStorage, "__new__", lambda fn: _with_device_rewrite(fn, "torch.UntypedStorage"))
    _wrap(torch.fft, "fftfreq", lambda fn: _with_device_rewrite(fn, "torch.fft.fftfreq"))
    _wrap(torch.fft, "rfftfreq", lambda fn: _with_device_rewrite(fn, "torch.fft.rfftfreq"))
    _wrap(torch.amp.autocast_mode.autocast, "__init__",
          lambda fn: _with_device_rewrite(fn, "torch.autocast"))
    _wrap(torch.amp.GradScaler, "__init__", lambda fn: _with_device_rewrite(fn, "torch.amp.GradScaler"))
    _wrap(torch.utils._device.DeviceContext, "__init__",
          lambda fn: _with_device_rewrite(fn, "torch.device context"))
    _set(torch, "Generator", _Generator)
    _set(torch, "Event", _Event)
    from torch.autograd.profiler_util import Kernel
    _wrap(Kernel, "__new__", lambda fn: _with_device_rewrite(fn, "torch.autograd.profiler_util.Kernel"))
    # Lazy modules allow a list of Tensor methods before materialisation: the patched `to` and
    # the npu/cuda moves (Module.cuda is Module.npu, which calls the generated Tensor.npu).
    from torch.nn.parameter import UninitializedTensorMixin
    allowed = UninitializedTensorMixin._allowed_methods
    before = list(allowed)
    allowed[:] = [torch.Tensor.to if getattr(m, "__name__", None) == "to" else m for m in allowed]
    allowed += [torch.Tensor.npu, torch.Tensor.cuda]
    _undo.append(lambda: allowed.__setitem__(slice(None), before))


def _patch_distributed() -> None:
    dist = torch.distributed
    if not dist.is_available():
        return
    importlib.import_module("torch.distributed.device_mesh")
    importlib.import_module("torch.nn.parallel")
    c10d = dist.distributed_c10d
    init = _with_hccl_backend(_with_device_rewrite(dist.init_process_group,
                                                   "torch.distributed.init_process_group"),
                              "torch.distributed.init_process_group")
    _set(dist, "init_process_group", init)
    _set(c10d, "init_process_group", init)
    _wrap(c10d, "_new_group_with_tag",
          lambda fn: _with_hccl_backend(fn, "torch.distributed.new_group"))
    _set(dist, "is_nccl_available", _is_hccl_available)
    _set(c10d, "is_nccl_available", _is_hccl_available)
    _wrap(dist.ProcessGroup, "_get_backend",
          lambda fn: _with_device_rewrite(fn, "torch.distributed.ProcessGroup._get_backend"))
    from opennpu.distributed import ProcessGroupHCCL
    _set(dist, "ProcessGroupNCCL", ProcessGroupHCCL)
    _set(c10d, "ProcessGroupNCCL", ProcessGroupHCCL)
    _del_nccl_device_backend_map()
    mesh = torch.distributed.device_mesh
    _wrap(mesh.DeviceMesh, "__init__", lambda fn: _with_device_rewrite(fn, "DeviceMesh"))
    _wrap(mesh, "init_device_mesh", lambda fn: _with_device_rewrite(fn, "init_device_mesh"))
    if getattr(dist, "init_device_mesh", None) is getattr(mesh.init_device_mesh, "_opennpu_original", None):
        _set(dist, "init_device_mesh", mesh.init_device_mesh)
    _wrap(torch.nn.parallel.DistributedDataParallel, "__init__",
          lambda fn: _with_device_rewrite(fn, "DistributedDataParallel"))
    _when_imported("torch.distributed.fsdp.fully_sharded_data_parallel", lambda m: _wrap(
        m.FullyShardedDataParallel, "__init__",
        lambda fn: _with_device_rewrite(fn, "FullyShardedDataParallel")))

    def pipelining(stage):
        _wrap(stage.PipelineStage, "__init__", lambda fn: _with_device_rewrite(fn, "PipelineStage"))
        _wrap(stage, "build_stage", lambda fn: _with_device_rewrite(fn, "build_stage"))
        package = sys.modules.get("torch.distributed.pipelining")
        if package is not None and hasattr(package, "build_stage"):
            _set(package, "build_stage", stage.build_stage)

    _when_imported("torch.distributed.pipelining.stage", pipelining)


def _patch_compilers() -> None:
    if os.environ.get("OPENNPU_TRANSFER_JIT_SCRIPT", "0") != "1":
        warnings.warn("transfer_to_npu: torch.jit.script and torch.jit.script_method return their "
                      "argument unchanged (it runs as Python, where CUDA devices are rewritten); "
                      "set OPENNPU_TRANSFER_JIT_SCRIPT=1 to keep TorchScript", RuntimeWarning,
                      stacklevel=4)
        _set(torch.jit, "script", _jit_script)
        _set(torch.jit, "script_method", _jit_script_method)
    triton_utils = importlib.import_module("torch.utils._triton")
    # Triton generates CUDA kernels: on npu it is absent even where the package is installed
    # (torch then never asks the CUDA-only questions, like the compute capability, it guards).
    for name in ("has_triton", "has_triton_package"):
        _replace_everywhere(triton_utils, name, _has_triton)
    for module in ("torch._inductor.utils", "torch._inductor.fx_passes.post_grad",
                   "torch._inductor.fx_passes.joint_graph", "torch._inductor.autotune_process"):
        _when_imported(module, lambda m: _set(m, "get_gpu_type", _gpu_type)
                       if hasattr(m, "get_gpu_type") else None)
    _replace_everywhere(torch._utils, "_get_available_device_type", _available_device_type)
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    if trace_rules is not None:  # ids of the callables replaced above are computed afresh
        ids = trace_rules._disallowed_callable_ids
        old = ids.function_ids
        ids.function_ids = None
        _undo.append(lambda: setattr(ids, "function_ids", old))
    _when_imported("torch.utils.cpp_extension", lambda m: _wrap(
        m, "include_paths", lambda fn: _with_device_rewrite(fn, "torch.utils.cpp_extension.include_paths")))


def apply() -> None:
    """Applies every patch (idempotent). Reads TORCH_NPU_MIGRATION_LOG: a path turns the log on."""
    global _applied, _log
    with _apply_lock:
        if _applied:
            return
        import opennpu  # noqa: F401  (registers the npu device and the hccl backend)
        # Under TORCH_TRANSFER_TO_NPU=1 this runs while `import torch` finishes: the patched
        # modules may not be loaded yet.
        for module in ("torch.utils._device", "torch.fft", "torch.amp", "torch.storage",
                       "torch.autograd.profiler_util", "torch.nn.parameter", "torch.cuda.amp",
                       "torch.cuda.random", "torch.cuda.memory", "torch.distributed"):
            importlib.import_module(module)
        path = os.environ.get("TORCH_NPU_MIGRATION_LOG")
        _log = _MigrationLog(path) if path else None
        try:
            _patch_cuda()
            _patch_cuda_only()
            _patch_serialization()
            _patch_tensors_and_modules()
            _patch_distributed()
            _patch_compilers()
            _patch_native_npu_libraries(_load_json_file(_NATIVE_NPU_APIS))
        except BaseException:
            _unpatch()
            raise
        _applied = True


def _unpatch() -> None:
    """Undoes apply() (tests only: objects created while patched keep what they captured)."""
    global _applied, _log
    while _undo:
        _undo.pop()()
    if _log is not None:
        _log.close()
        _log = None
    _applied = False


def enable_from_env() -> None:
    """TORCH_TRANSFER_TO_NPU=1 applies the patches; 0 (the default) does nothing; any other value
    is a ValueError, as in torch_npu."""
    value = os.environ.get("TORCH_TRANSFER_TO_NPU", "0")
    if value == "1":
        apply()
    elif value != "0":
        raise ValueError(f"Invalid value for TORCH_TRANSFER_TO_NPU: {value}. "
                         "Only '0' or '1' is supported.")
