"""torchair.inference: cache_compile, readable_cache and set_dim_gears.

cache_compile keeps a function's compiled graphs on disk so that a later process starts without
compiling them again. TorchAir caches Dynamo's bytecode and GE's compiled graph; opennpu caches
what its compile path produces after Dynamo: AOTAutograd's and Inductor's compiled graphs
(torch.compiler.save_cache_artifacts) and the record of what the fusion passes did (so the
counters, dumps and logs report a cache-served start as they report a compile). Dynamo still
traces the function at each start, which takes a fraction of the compile time; guards run as
usual, so unlike TorchAir's cache a changed script or a recompile is handled, never wrongly
served: every cached graph is keyed by its content.

set_dim_gears marks dimensions dynamic over the range of their gears: one symbolic graph serves
every gear (GE instead builds one graph per gear, which is why the gear values are constrained).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from ..backend import NpuBackend
from ..config import CompilerConfig
from .logger import logger

CACHE_FILE = "compiled_module"
FORMAT_VERSION = 1


def _cache_folder(func: Callable, config: CompilerConfig, dynamic: bool, cache_dir: str | None,
                  global_rank: int | None, tp_rank: int | None, pp_rank: int | None,
                  decompositions: dict) -> Path:
    """{cache_dir}/{Model}_{dynamic|static}_{md5}/[world{n}global_rank{r}/]{func}, TorchAir's
    layout; the md5 covers what changes the compiled result besides the graph itself."""
    owner = getattr(func, "__self__", None)
    model = type(owner).__name__ if owner is not None else "function"
    constraint = "|".join([
        getattr(func, "__qualname__", repr(func)), config.fingerprint(), str(dynamic),
        f"tp{tp_rank}pp{pp_rank}", ",".join(sorted(str(op) for op in decompositions)),
        torch.__version__])
    md5 = hashlib.md5(constraint.encode()).hexdigest()
    folder = Path(cache_dir if cache_dir is not None else ".torchair_cache")
    folder = folder / f"{model}_{'dynamic' if dynamic else 'static'}_{md5}"
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rank = global_rank if global_rank is not None else dist.get_rank()
        folder = folder / f"world{dist.get_world_size()}global_rank{rank}"
    return folder / getattr(func, "__name__", "func")


class CacheCompiledFunction:
    """What cache_compile returns: call it as the function. `path` is its cache file, `loaded`
    whether this process started from it, `backend` the backend that compiled it."""

    def __init__(self, func: Callable, config: CompilerConfig, backend: NpuBackend, dynamic: bool,
                 path: Path):
        self.func, self.config, self.backend, self.dynamic, self.path = (
            func, config, backend, dynamic, path)
        self.loaded = False
        self._compiled = None
        self._name = f"{getattr(func, '__qualname__', repr(func))}"

    def _load(self) -> None:
        try:
            entry = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as error:
            logger.warning("cache_compile: %s is not a readable cache (%s); compiling anew",
                           self.path, error)
            return
        if entry.get("format") != FORMAT_VERSION or entry.get("torch") != torch.__version__:
            logger.info("cache_compile: %s was written by another version; compiling anew",
                        self.path)
            return
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        records = Path(cache_dir()) / "opennpu_passes"
        records.mkdir(parents=True, exist_ok=True)
        for key, text in entry["pass_records"].items():
            (records / f"{key}.json").write_text(text)
        if entry["artifacts"]:
            torch.compiler.load_cache_artifacts(base64.b64decode(entry["artifacts"]))
        self.loaded = True
        logger.info("Cache %s loaded from %s", entry["meta"], self.path)

    def _save(self) -> None:
        saved = torch.compiler.save_cache_artifacts()
        records = {r.key: r.path.read_text() for r in self.backend.pass_records if r.path.exists()}
        meta = {"name": self._name, "date": str(datetime.datetime.now()), "version": "1.0.0"}
        entry = {
            "format": FORMAT_VERSION, "torch": torch.__version__, "meta": meta,
            "artifacts": base64.b64encode(saved[0]).decode() if saved is not None else "",
            "pass_records": records,
            # from the records: a compile the local caches served has texts, not GraphModules
            "graphs": {f"{phase}_{i}": kept["py"] for i, text in enumerate(records.values())
                       for phase, kept in json.loads(text).items()},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_name(f"{CACHE_FILE}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps(entry))
        scratch.replace(self.path)
        logger.info("Cache %s saved to %s", meta, self.path)

    def __call__(self, *args, **kwargs):
        if self._compiled is not None:
            with torch.no_grad():
                return self._compiled(*args, **kwargs)
        self._load()
        self._compiled = torch.compile(self.func, backend=self.backend, dynamic=self.dynamic,
                                       fullgraph=True)
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        # The cached artifacts are AOTAutograd's and Inductor's cache entries: both caches on.
        with torch.no_grad(), inductor_config.patch(fx_graph_cache=True), \
                functorch_config.patch(enable_autograd_cache=True):
            out = self._compiled(*args, **kwargs)
        if not self.loaded:
            self._save()
        return out


def cache_compile(func: Callable, *, config: CompilerConfig | None = None, backend: Any = None,
                  dynamic: bool = True, cache_dir: str | None = None,
                  global_rank: int | None = None, tp_rank: int | None = None,
                  pp_rank: int | None = None, ge_cache: bool = False,
                  custom_decompositions: dict | None = None, **kwargs) -> CacheCompiledFunction:
    """Compile `func` (typically a module's method) with opennpu's backend, under no_grad and as
    one graph, keeping the compiled graphs in `cache_dir` (default ".torchair_cache") for later
    processes. See the module docstring for what is cached. `backend`, when given, must be a
    get_npu_backend() backend; with `config` as well, it must carry that config. `ge_cache`
    (GE's compiled-graph cache) is accepted and has no effect: the compiled graphs are always
    cached here. Other keyword arguments are refused by name."""
    if not callable(func):
        raise TypeError(f"cache_compile: func must be callable, got {type(func).__name__}")
    if kwargs:
        raise TypeError(f"cache_compile: unexpected keyword arguments {sorted(kwargs)}; accepted "
                        f"are config, backend, dynamic, cache_dir, global_rank, tp_rank, "
                        f"pp_rank, ge_cache, custom_decompositions")
    for name, value in (("dynamic", dynamic), ("ge_cache", ge_cache)):
        if not isinstance(value, bool):
            raise TypeError(f"cache_compile: {name} must be bool, got {type(value).__name__}")
    if config is not None and not isinstance(config, CompilerConfig):
        raise TypeError(f"cache_compile: config must be a CompilerConfig, got "
                        f"{type(config).__name__}")
    if backend is not None:
        if not isinstance(backend, NpuBackend):
            raise TypeError(f"cache_compile: backend must come from get_npu_backend(), got "
                            f"{type(backend).__name__}")
        if config is not None and config.as_dict() != backend.config.as_dict():
            raise ValueError("cache_compile: config differs from the config of backend; pass "
                             "one of them, or the same config to both")
        if custom_decompositions is not None:
            raise ValueError("cache_compile: custom_decompositions belong to the backend; pass "
                             "them to get_npu_backend() when passing a backend")
    else:
        backend = NpuBackend(config if config is not None else CompilerConfig(),
                             custom_decompositions)
    path = _cache_folder(func, backend.config, dynamic, cache_dir, global_rank, tp_rank, pp_rank,
                         backend.decompositions) / CACHE_FILE
    return CacheCompiledFunction(func, backend.config, backend, dynamic, path)


def readable_cache(cache_bin: str | os.PathLike, print_output: bool = True,
                   file: str | os.PathLike | None = None) -> str:
    """The cache file `cache_bin` as text: what was cached and the graphs after fusion."""
    path = Path(cache_bin)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"readable_cache: {path} is not a cache_compile cache file "
                         f"({type(error).__name__}: {error})") from None
    if not isinstance(entry, dict) or "meta" not in entry:
        raise ValueError(f"readable_cache: {path} is not a cache_compile cache file")
    lines = [f"# cache of {entry['meta']['name']}, written {entry['meta']['date']} "
             f"(torch {entry['torch']})",
             f"# compiled graphs: {len(base64.b64decode(entry['artifacts']))} bytes of "
             f"AOTAutograd / Inductor cache artifacts",
             f"# fusion records: {len(entry['pass_records'])}", ""]
    for name, code in entry["graphs"].items():
        lines += [f"# ---- {name} graph after opennpu's passes ----", code, ""]
    text = "\n".join(lines)
    if print_output:
        print(text)
    if file is not None:
        Path(file).write_text(text)
    return text


_MAX_GEARS = 100


def set_dim_gears(t: torch.Tensor, dim_gears: dict[int, list[int] | tuple[int, ...]]) -> None:
    """Mark each dimension of `dim_gears` dynamic between its smallest and largest gear.

    TorchAir's constraints are checked (gears are ints >= 2, at most 100 combinations, a tensor's
    gears are set once); the graph compiled for `t` then serves every gear, and sizes between
    gears as well. A size outside a dimension's range makes Dynamo compile again. Use with
    torch.compile(dynamic=True), as in TorchAir."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"set_dim_gears: t must be a Tensor, got {type(t).__name__}")
    if not isinstance(dim_gears, dict) or not dim_gears:
        raise TypeError(f"set_dim_gears: dim_gears must be a non-empty dict "
                        f"{{dim: [gears]}}, got {dim_gears!r}")
    gears: dict[int, tuple[int, ...]] = {}
    combinations = 1
    for dim, values in dim_gears.items():
        if isinstance(dim, bool) or not isinstance(dim, int) or not -t.dim() <= dim < t.dim():
            raise ValueError(f"set_dim_gears: dim must be an int in [{-t.dim()}, {t.dim()}) for "
                             f"a {t.dim()}-d tensor, got {dim!r}")
        if (not isinstance(values, (list, tuple)) or not values
                or any(isinstance(v, bool) or not isinstance(v, int) for v in values)):
            raise TypeError(f"set_dim_gears: the gears of dim {dim} must be a non-empty list or "
                            f"tuple of ints, got {values!r}")
        if min(values) < 2:
            raise ValueError(f"set_dim_gears: gears must be >= 2 (sizes 0 and 1 are always "
                             f"specialised), dim {dim} has {list(values)}")
        gears[dim % t.dim()] = tuple(sorted(set(values)))
        combinations *= len(gears[dim % t.dim()])
    if combinations > _MAX_GEARS:
        raise ValueError(f"set_dim_gears: {combinations} gear combinations, at most "
                         f"{_MAX_GEARS} are allowed")
    previous = getattr(t, "_torchair_dim_gears", None)
    if previous is not None and previous != gears:
        raise ValueError(f"set_dim_gears: the tensor already has gears {previous}; a tensor's "
                         f"gears are set once, got {gears}")
    for dim, values in gears.items():
        if t.shape[dim] not in values:
            raise ValueError(f"set_dim_gears: dim {dim} has size {t.shape[dim]}, which is not "
                             f"one of its gears {list(values)}")
        if len(values) > 1:
            torch._dynamo.mark_dynamic(t, dim, min=values[0], max=values[-1])
    t._torchair_dim_gears = gears
