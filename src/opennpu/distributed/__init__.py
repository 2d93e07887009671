"""The `hccl` process-group backend for the npu device.

npu memory is host memory, so a collective on npu tensors is gloo's collective on CPU tensors that
alias the same bytes (torch.ops.opennpu._npu_cpu_alias: no copy in or out; what gloo writes into
the alias is the npu tensor's data). `ProcessGroupHCCL` is a Python `torch.distributed.ProcessGroup`
(PyTorch's trampoline class, as its `threaded` backend uses) holding one ProcessGroupGloo; each
collective replaces the npu tensors among its arguments by their CPU aliases and runs gloo's, CPU
tensors passing through unchanged, and returns gloo's Work (wait, is_completed, get_future, the
timeout all gloo's). Registered through `torch.distributed.Backend.register_backend("hccl", ...,
devices=["npu"])`, so `init_process_group("hccl")`, `init_process_group()` (npu is the
accelerator) and `"cpu:gloo,npu:hccl"` all give it. See docs/distributed.md.
"""

from __future__ import annotations

import functools
import hashlib
import os
import queue
import socket
import threading
import uuid
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions, _create_work_from_future

__all__ = ["ProcessGroupHCCL", "register"]

_alias = None
_ALLTOALL_TAG = 0x4C4C  # the tag of all_to_all's point-to-point messages


def _to_cpu(x):
    """x with each npu tensor replaced by a CPU tensor over the same memory (lists recursed)."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "npu":
            return _alias(x)
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(e) for e in x)
    return x


# ProcessGroup methods that torch.distributed's Python functions call, with their gloo namesakes.
_FORWARDED = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce",
    "allgather_coalesced", "reduce_scatter", "gather", "scatter",
    "alltoall_base", "send", "recv", "recv_anysource",
)

# Which arguments every rank passes alike (the same shapes and dtypes), checked across ranks before
# the collective runs: gloo itself aborts the process on a size mismatch ("Received data size
# doesn't match expected size") or reduces garbage. "all": every tensor argument; an index: that
# argument only (gather's outputs and scatter's inputs exist on the root alone); "dtype": dtypes
# only (all_to_all's splits may differ by rank). Point-to-point ops are not checked. all_gather's
# outputs hold every rank's shape, which may differ by rank (HCCL allows it), so they are what
# all ranks pass alike.
_CHECKED = {
    "allreduce": "all", "allreduce_coalesced": "all", "broadcast": "all", "reduce": "all",
    "allgather": 0, "_allgather_base": "all", "allgather_coalesced": "all",
    "reduce_scatter": "all", "_reduce_scatter_base": "all", "gather": 1, "scatter": 0,
    "alltoall_base": "dtype", "alltoall": "dtype", "allgather_into_tensor_coalesced": "all",
    "reduce_scatter_tensor_coalesced": "all",
}
_OPS = {name: i for i, name in enumerate(_CHECKED)}
# A dtype's number, the same in every process running this torch.
_DTYPES = {d: i for i, d in enumerate(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)},
                                             key=str))}
_FP_LEN = 8
# OPENNPU_HCCL_CHECK: "1" (default) checks each collective without blocking its caller (the
# group's launcher thread starts the collective once the check passed); "sync" checks it in the
# calling thread before starting it; "0" does not check. See docs/distributed.md.
_CHECK_MODE = os.environ.get("OPENNPU_HCCL_CHECK", "1").strip().lower()
_CHECK = _CHECK_MODE not in ("0", "off", "false", "no")
_DEFERRED = _CHECK and _CHECK_MODE != "sync"


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for e in x:
            yield from _tensors(e)


def _fingerprint(name: str, args) -> list:
    what = _CHECKED[name]
    ts = list(_tensors(args if what in ("all", "dtype") else args[what]))
    first = ts[0] if ts else None
    dtype = -1 if first is None else _DTYPES.get(first.dtype, -2)
    if what == "dtype":
        return [_OPS[name], dtype] + [-1] * (_FP_LEN - 2)
    shape = list(first.shape[:4]) if first is not None else []
    return ([_OPS[name], dtype, len(ts), sum(t.numel() for t in ts), len(shape)] + shape + [-1] * 4)[:_FP_LEN]


def _describe(fp: list) -> str:
    if fp[0] < 0 or fp[0] >= len(_OPS):
        return "?"
    op = list(_OPS)[fp[0]]
    dtype = next((str(d).removeprefix("torch.") for d, i in _DTYPES.items() if i == fp[1]), "?")
    if fp[2] == -1:
        return f"{op} of {dtype}"
    return f"{op} of {fp[2]} tensor(s), {fp[3]} elements, dtype {dtype}, first shape {tuple(fp[5:5 + min(fp[4], 3)])}"


def _env_seconds(name: str) -> timedelta | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of seconds") from None
    return timedelta(seconds=seconds) if seconds > 0 else None


def _hccl_timeouts(timeout: timedelta) -> tuple[timedelta, timedelta]:
    """(connection timeout, collective timeout) of a new group. A `timeout=` given to
    init_process_group / new_group (anything but torch's default) applies to both, as for gloo;
    with torch's default, HCCL_CONNECT_TIMEOUT (seconds) bounds connecting the ranks and
    HCCL_EXEC_TIMEOUT (seconds) each collective, as on Ascend. Unset or 0: torch's default."""
    if timeout != dist.constants.default_pg_timeout:
        return timeout, timeout
    execute = _env_seconds("HCCL_EXEC_TIMEOUT") or timeout
    return _env_seconds("HCCL_CONNECT_TIMEOUT") or execute, execute


def _gloo_options(timeout: timedelta):
    """gloo's options: TIMEOUT and the network interface. GLOO_SOCKET_IFNAME as gloo reads it;
    where it is unset, HCCL_SOCKET_IFNAME (interface names, comma-separated; a leading "=" for
    an exact match is accepted, "^" exclusion lists are not mapped) or HCCL_IF_IP (the address of
    the interface to use); else gloo's default (the interface of this host's name)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    gloo_ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").strip()
    hccl_ifname = os.environ.get("HCCL_SOCKET_IFNAME", "").strip()
    if hccl_ifname.startswith("^"):
        hccl_ifname = ""
    if_ip = os.environ.get("HCCL_IF_IP", "").strip()
    if gloo_ifname or hccl_ifname:
        names = (gloo_ifname or hccl_ifname.lstrip("=")).split(",")
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=n.strip()) for n in names if n.strip()]
    elif if_ip:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=if_ip)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return opts


class ProcessGroupHCCL(dist.ProcessGroup):
    """torch.distributed's hccl backend on the emulated npu device: gloo on CPU aliases."""

    class Options:
        """torch_npu's ProcessGroupHCCL.Options (scripts build them to pass as `pg_options`):
        the fields are accepted; the backend over gloo has no use for them."""

        def __init__(self, is_high_priority_stream: bool = False):
            self.is_high_priority_stream = is_high_priority_stream
            self.hccl_config: dict = {}
            self.global_ranks_in_group: list[int] = []
            self.group_name = ""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        connect, timeout = _hccl_timeouts(timeout)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, _gloo_options(connect))
        if timeout != connect:
            self._gloo._set_default_timeout(timeout)
        self._timeout = timeout
        self._launcher = None
        self._rendezvous = _open_rendezvous(self._gloo, rank, size) if _CHECK and size > 1 else None
        if self._rendezvous is not None:
            weakref.finalize(self, torch.ops.opennpu._hccl_rendezvous_close, self._rendezvous)
        self._fingerprints = functools.partial(_fingerprints, self._gloo, self._rendezvous, size,
                                               timeout.total_seconds())
        # Group names and descriptions live on a ProcessGroup's backends (ProcessGroup::
        # getGroupName reads its first backend's), and DeviceMesh / FSDP2 read them: gloo is this
        # group's backend for both devices as far as C++ is concerned.
        for device in ("cpu", "npu"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, self._gloo)

    def getBackendName(self) -> str:  # noqa: N802  (ProcessGroup's name)
        return "hccl"

    def name(self) -> str:
        return "hccl"

    def _check(self, name: str, args) -> None:
        """Raises the same error on every rank when the ranks' collectives differ in kind, dtype or
        shape (an exchange of each rank's fingerprint), before the collective starts. Used where the
        collective runs in the calling thread (all_to_all with lists, sync mode)."""
        if not _CHECK or self.size() == 1:
            return
        self._drain()
        error = _mismatch(self._fingerprints(_fingerprint(name, args)), self.size())
        if error is not None:
            raise error

    def _run(self, name, args, cpu_args, start):
        """Runs collective NAME (start(): gloo's Work on the CPU aliases cpu_args), checked across
        ranks.

        Deferred mode: a Work comes back at once; the group's launcher thread, taking the
        collectives in the order they were called, exchanges the fingerprints and starts the
        collective only if every rank's matched, else fails the Work with the mismatch error on
        every rank. Exchanges and collectives all start from that one thread, in call order, so
        gloo numbers them alike on every rank; nothing reaches gloo's data messages before the
        check passed. The Work's result holds the npu tensors (gloo's would be their aliases).
        On one host, with nothing queued, the caller publishes its fingerprint itself and, if
        every rank's is already there (it is the last to arrive), starts the collective at once;
        else the launcher only waits for the others'.
        """
        # The collective's npu tensors, as its Work's result: the value _npu_work's future gives, and
        # the launcher's where gloo's Work has no future.
        result = list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]
        if not _CHECK or self.size() == 1 or name not in _CHECKED:
            return _npu_work(name, start(), result)
        if not _DEFERRED:
            self._check(name, args)
            return _npu_work(name, start(), result)
        mine = _fingerprint(name, args)
        if self._launcher is None:
            self._launcher = _Launcher(self.size())
            weakref.finalize(self, self._launcher.stop)
        if self._rendezvous is not None and self._launcher.idle():
            number = torch.ops.opennpu._hccl_rendezvous_publish(self._rendezvous, mine)
            every = torch.ops.opennpu._hccl_rendezvous_collect(self._rendezvous, number, 0.0)
            if every:
                error = _mismatch(every, self.size())
                if error is None:
                    return _npu_work(name, start(), result)
                fut = torch.futures.Future()
                fut.set_exception(error)
                return _CheckedWork(fut)
            fingerprints = functools.partial(torch.ops.opennpu._hccl_rendezvous_collect, self._rendezvous,
                                             number, self._timeout.total_seconds())
        else:
            fingerprints = functools.partial(self._fingerprints, mine)
        originals = {id(c): t for c, t in zip(_tensors(cpu_args), _tensors(args)) if c is not t}
        fut = torch.futures.Future()
        self._launcher.submit((fingerprints, start, fut, originals, result))
        return _CheckedWork(fut)

    def _drain(self) -> None:
        """Waits until the launcher has started every deferred collective (before one that starts
        from the calling thread, so that gloo sees them in the order they were called)."""
        if self._launcher is not None:
            self._launcher.drain()

    def barrier(self, opts=None):
        gloo_opts = dist.BarrierOptions()
        if opts is not None:
            gloo_opts.timeout = opts.timeout
        self._drain()
        return self._gloo.barrier(gloo_opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """all_to_all with tensor lists, which gloo lacks: a send and a receive per peer (its
        tensors sent in place, no staging), finished before it returns."""
        self._check("alltoall", (output_tensors, input_tensors))
        outs, ins = _to_cpu(list(output_tensors)), _to_cpu(list(input_tensors))
        rank, size = self.rank(), self.size()
        if len(outs) != size or len(ins) != size:
            raise ValueError(f"all_to_all: expected {size} input and output tensors, got "
                             f"{len(ins)} and {len(outs)}")
        outs[rank].copy_(ins[rank])
        works = []
        for step in range(1, size):
            to, frm = (rank + step) % size, (rank - step) % size
            works.append(self._gloo.send([ins[to].contiguous()], to, _ALLTOALL_TAG))
            works.append(self._gloo.recv([outs[frm]], frm, _ALLTOALL_TAG))
        for w in works:
            w.wait()
        fut = torch.futures.Future()
        fut.set_result(list(output_tensors))
        return _create_work_from_future(fut)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """all_gather. Ranks may contribute tensors of different shapes, as on HCCL (every rank's
        output list holds each rank's shape); gloo wants one shape, so such a call gathers padded
        flat copies and unpacks them, finished before it returns."""
        outs, inp = output_tensors[0], input_tensors[0]
        if len(output_tensors) != 1 or len(input_tensors) != 1 or all(o.shape == inp.shape for o in outs):
            cpu_args = _to_cpu((output_tensors, input_tensors))
            return self._run("allgather", (output_tensors, input_tensors), cpu_args,
                             lambda: self._gloo.allgather(*cpu_args, opts or AllgatherOptions()))
        rank, size = self.rank(), self.size()
        if len(outs) != size or outs[rank].numel() != inp.numel():
            raise ValueError(f"all_gather: expected {size} output tensors, this rank's with its input's "
                             f"{inp.numel()} elements, got {len(outs)}"
                             + (f" (this rank's has {outs[rank].numel()})" if len(outs) == size else ""))
        width = max(o.numel() for o in outs)
        send = torch.zeros(width, dtype=inp.dtype)
        send[:inp.numel()].copy_(_to_cpu(inp).reshape(-1))
        gathered = torch.empty(size * width, dtype=inp.dtype)
        self._run("allgather", (output_tensors, input_tensors), (),
                  lambda: self._gloo._allgather_base(gathered, send, AllgatherOptions())).wait()
        for r, out in enumerate(_to_cpu(list(outs))):
            out.copy_(gathered[r * width:r * width + out.numel()].view(out.shape))
        fut = torch.futures.Future()
        fut.set_result(list(outs))
        return _create_work_from_future(fut)

    # all_gather_into_tensor / reduce_scatter_tensor take the world-sized tensor in any shape with
    # the right number of elements, as NCCL and HCCL do (accelerate gathers into a flat tensor);
    # gloo wants it shaped as the per-rank tensors stacked on dim 0, so it gets such a view.
    def _allgather_base(self, output, input, opts=None):
        out, inp = _stacked_views(_to_cpu(output), _to_cpu(input), self.size(), "all_gather_into_tensor")
        return self._run("_allgather_base", (output, input), (out, inp),
                         lambda: self._gloo._allgather_base(out, inp, opts or AllgatherOptions()))

    def _reduce_scatter_base(self, output, input, opts=None):
        inp, out = _stacked_views(_to_cpu(input), _to_cpu(output), self.size(), "reduce_scatter_tensor")
        return self._run("_reduce_scatter_base", (output, input), (out, inp),
                         lambda: self._gloo._reduce_scatter_base(out, inp, opts or ReduceScatterOptions()))

    # The coalesced tensor collectives (functional collectives, FSDP2, DTensor call them) have no
    # gloo binding: one gloo collective per pair, the Work finishing when all have.
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or AllgatherOptions()
        pairs = [_stacked_views(_to_cpu(o), _to_cpu(i), self.size(), "all_gather_into_tensor")
                 for o, i in zip(outputs, inputs)]
        return self._run("allgather_into_tensor_coalesced", (outputs, inputs), (), lambda: _all_of(
            [self._gloo._allgather_base(o, i, opts) for o, i in pairs], list(outputs)))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or ReduceScatterOptions()
        pairs = [_stacked_views(_to_cpu(i), _to_cpu(o), self.size(), "reduce_scatter_tensor")
                 for o, i in zip(outputs, inputs)]
        return self._run("reduce_scatter_tensor_coalesced", (outputs, inputs), (), lambda: _all_of(
            [self._gloo._reduce_scatter_base(o, i, opts) for i, o in pairs], list(outputs)))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self._drain()
        return self._gloo.monitored_barrier(timeout or self._timeout, wait_all_ranks)


def _stacked_views(whole, part, size: int, op: str):
    """(whole, part) viewed as gloo wants them: `whole` as `size` copies of `part` along dim 0.

    `whole` must be contiguous with size * part.numel() elements (NCCL's only requirement); a
    0-dim `part` becomes shape (1,).
    """
    if whole.numel() != size * part.numel():
        raise ValueError(f"{op}: the world-sized tensor must have world_size * {part.numel()} = "
                         f"{size * part.numel()} elements, but it has {whole.numel()} "
                         f"(shape {tuple(whole.shape)})")
    if part.dim() == 0:
        part = part.view(1)
    if whole.shape[0] == size * part.shape[0] and whole.shape[1:] == part.shape[1:]:
        return whole, part
    if not whole.is_contiguous():
        raise ValueError(f"{op}: a world-sized tensor of shape {tuple(whole.shape)} must be "
                         "contiguous when it is not shaped as the per-rank tensors stacked on dim 0")
    return whole.view(size * part.shape[0], *part.shape[1:]), part


def _all_of(works, result):
    """A Work done when every one of `works` is, its result `result`."""
    if len(works) == 1:
        return works[0]
    fut = torch.futures.collect_all([w.get_future() for w in works]).then(lambda f: (f.wait(), result)[1])
    return _create_work_from_future(fut)


def _open_rendezvous(gloo, rank: int, size: int) -> int | None:
    """The handle of the group's same-host rendezvous (csrc/distributed/hccl_rendezvous.cpp), or
    None where the ranks are not all on this host or the shared file cannot be made: the check then
    exchanges fingerprints through gloo. Agreed through a few collectives on the group's own gloo
    (its connections are up once it is constructed), never through store keys, which a group
    re-created on the same store (torchrun's agent store) would find left over from the last one."""

    def every(values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.int64)
        out = torch.empty(size * len(values), dtype=torch.int64)
        gloo._allgather_base(out, mine, AllgatherOptions()).wait()
        return out.view(size, len(values)).tolist()

    # Rank 0's nonce names the file; every rank's host identity says whether one file can serve.
    nonce = uuid.uuid4().int & (2 ** 63 - 1)
    usable = int(os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK))
    rows = every([nonce, _host_identity_hash(), usable])
    if any(row[1:] != [rows[0][1], 1] for row in rows):
        return None
    path = f"/dev/shm/opennpu-hccl-{rows[0][0]:016x}"

    def open_file(create: bool) -> int | None:
        try:
            return torch.ops.opennpu._hccl_rendezvous_open(path, size, rank, _FP_LEN, create)
        except RuntimeError:
            return None

    handle = open_file(True) if rank == 0 else None
    created = every([int(handle is not None)])[0][0]  # rank 0's row: the file exists
    if rank != 0 and created:
        handle = open_file(False)
    opened = all(row[0] for row in every([int(handle is not None)]))
    if rank == 0 and handle is not None:
        os.unlink(path)  # every rank that could open it has: nothing is left behind on any exit
    if not opened:
        if handle is not None:
            torch.ops.opennpu._hccl_rendezvous_close(handle)
        return None
    return handle


def _host_identity_hash() -> int:
    return int.from_bytes(hashlib.sha256(_host_identity().encode()).digest()[:8], "little") & (2 ** 63 - 1)


def _host_identity() -> str:
    """Equal for processes that share this kernel and this /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        shm = os.stat("/dev/shm")
    except OSError:
        return f"{socket.gethostname()}/{os.getpid()}"  # unique: no shared-memory rendezvous
    return f"{socket.gethostname()}/{boot}/{shm.st_dev}/{shm.st_ino}"


def _fingerprints(gloo, rendezvous: int | None, size: int, timeout_s: float, mine: list) -> list:
    """Every rank's fingerprint of the collective about to run, rank after rank, once every rank
    has published its own: through shared memory on one host, else a gloo all_gather."""
    if rendezvous is not None:
        number = torch.ops.opennpu._hccl_rendezvous_publish(rendezvous, mine)
        return torch.ops.opennpu._hccl_rendezvous_collect(rendezvous, number, timeout_s)
    every = torch.empty(size * _FP_LEN, dtype=torch.int64)
    gloo._allgather_base(every, torch.tensor(mine, dtype=torch.int64), AllgatherOptions()).wait()
    return every.tolist()


def _mismatch(every: list, size: int) -> RuntimeError | None:
    rows = [every[r * _FP_LEN:(r + 1) * _FP_LEN] for r in range(size)]
    if all(row == rows[0] for row in rows):
        return None
    ranks = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(rows))
    return RuntimeError(f"hccl: ranks called mismatched collectives ({ranks}); every rank must "
                        "call the same collective with the same shapes and dtypes")


class _CheckedWork(dist.Work):
    """The Work of a deferred collective: done when its future is; wait() raises its error (the
    Work c10d makes from a future would return without raising)."""

    def __init__(self, fut):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None):
        self._fut.wait()
        return True

    def get_future(self):
        return self._fut

    def is_completed(self):
        return self._fut.done()

    def is_success(self):
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True


class _Launcher:
    """A group's launcher thread: starts each deferred collective, in call order, once the
    exchange of its fingerprints is done and they match."""

    def __init__(self, size: int):
        self._size = size
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._cond = threading.Condition()
        threading.Thread(target=self._loop, name="hccl-launcher", daemon=True).start()

    def submit(self, item) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put(item)

    def drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def idle(self) -> bool:
        """Nothing queued or running (only the calling thread submits, so it stays so)."""
        return self._pending == 0

    def stop(self) -> None:
        """Ends the thread (the group is gone). The thread holds no reference to the group or its
        gloo between collectives, so that destroying the group releases its connections and store."""
        self._queue.put(None)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fingerprints, start, fut, originals, result = item
            del item
            try:
                _launch(fingerprints(), self._size, start, fut, originals, result)
            except Exception as e:  # noqa: BLE001  (a timeout, handed to the caller's Work)
                if not fut.done():
                    fut.set_exception(e)
            fingerprints = start = fut = originals = result = None
            with self._cond:
                self._pending -= 1
                if self._pending == 0:
                    self._cond.notify_all()


def _launch(every: list, size: int, start, fut, originals, result) -> None:
    """Starts the collective if every rank's fingerprint matched, else fails its Work; fut gets
    the collective's result (its npu tensors) when gloo's Work completes."""
    error = _mismatch(every, size)
    if error is not None:
        fut.set_exception(error)
        return
    try:
        started = start()
        try:
            done = started.get_future()
        except RuntimeError:  # a gloo Work without a future (_reduce_scatter_base's)
            started.wait()
            fut.set_result(result)
        else:
            done.add_done_callback(lambda f, fut=fut, originals=originals: _settle(fut, f, originals))
    except Exception as e:  # noqa: BLE001  (handed to the caller's Work)
        if not fut.done():
            fut.set_exception(e)


def _settle(fut, done, originals) -> None:
    try:
        value = done.value()
    except Exception as e:  # noqa: BLE001
        fut.set_exception(e)
        return
    fut.set_result(_restore(value, originals))


def _restore(x, originals):
    """x with the CPU aliases in `originals` replaced by their npu tensors (lists recursed)."""
    if isinstance(x, torch.Tensor):
        return originals.get(id(x), x)
    if isinstance(x, (list, tuple)):
        return type(x)(_restore(e, originals) for e in x)
    return x


# Collectives whose gloo future's value is the list of their first argument's tensors.
_FLAT_RESULT = frozenset({"allreduce", "allreduce_coalesced", "broadcast", "reduce"})


def _npu_work(name: str, work, npu_tensors: list):
    """gloo's Work of collective NAME, seen as the npu collective's: its future's value and
    result() are the npu tensors rather than gloo's CPU aliases of them (the continuation runs in
    C++ on gloo's thread, without the GIL)."""
    if name not in _FLAT_RESULT or not any(t.device.type == "npu" for t in npu_tensors):
        return work
    return dist.Work.unbox(torch.ops.opennpu._hccl_npu_work(work.boxed(), npu_tensors))


def _forward(name):
    def method(self, *args):
        cpu_args = _to_cpu(args)
        gloo_method = getattr(self._gloo, name)
        return self._run(name, args, cpu_args, lambda: gloo_method(*cpu_args))

    method.__name__ = name
    method.__doc__ = f"gloo's {name} on CPU aliases of the npu tensors."
    return method


for _name in _FORWARDED:
    setattr(ProcessGroupHCCL, _name, _forward(_name))
del _name


# ReduceOp.AVG and PREMUL_SUM, which HCCL has and gloo lacks: PREMUL_SUM(f) scales the inputs by f
# (in place for the in-place allreduce and reduce, else a scaled copy) and sums; AVG sums and then
# divides the result by the group size (integers rounding down, as HCCL), after waiting for the sum:
# an AVG collective completes before it returns.
_AVG, _PREMUL = dist.ReduceOp.RedOpType.AVG, dist.ReduceOp.RedOpType.PREMUL_SUM


def _special_op(opts):
    """(kind, factor) of opts' reduce op: kind None (gloo's own op), "avg" or "premul"; the op is
    replaced by SUM in opts when it is one of the two."""
    op = getattr(opts, "reduceOp", None)
    kind = getattr(op, "op", None)
    if kind == _AVG:
        opts.reduceOp = dist.ReduceOp.SUM
        return "avg", None
    if kind == _PREMUL:
        factor = op.__getstate__()[1]
        opts.reduceOp = dist.ReduceOp.SUM
        return "premul", factor
    return None, None


def _average(tensors, size: int):
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            t.div_(size)
        else:
            t.div_(size, rounding_mode="floor")


def _finished(work, outputs, size: int):
    """Waits for WORK, divides OUTPUTS by SIZE, and returns a completed Work."""
    work.wait()
    _average(outputs, size)
    fut = torch.futures.Future()
    fut.set_result(list(outputs))
    return _create_work_from_future(fut)


def _with_reduce_ops(name, gloo_opts, inputs, outputs, in_place: bool):
    """Wraps the forwarded method NAME with AVG / PREMUL_SUM (gloo_opts: its options type;
    inputs(args) / outputs(args): its input and output tensors; in_place: inputs are outputs)."""
    forward = getattr(ProcessGroupHCCL, name)

    def method(self, *args):
        args = list(args)
        opts = args[-1] if len(args) > 1 and isinstance(args[-1], gloo_opts) else None
        kind, factor = _special_op(opts) if opts is not None else (None, None)
        if kind == "premul":
            if in_place:
                for t in inputs(args):
                    t.mul_(factor)
            else:
                args = _replace_inputs(name, args, factor)
        work = forward(self, *args)
        if kind == "avg":
            return _finished(work, outputs(self, args), self.size())
        return work

    method.__name__ = name
    method.__doc__ = forward.__doc__
    setattr(ProcessGroupHCCL, name, method)


def _replace_inputs(name, args, factor):
    if name == "reduce_scatter":  # (outputs, input_lists, opts)
        args[1] = [[t * factor for t in ts] for ts in args[1]]
    else:  # _reduce_scatter_base: (output, input, opts)
        args[1] = args[1] * factor
    return args


_with_reduce_ops("allreduce", dist.AllreduceOptions, lambda a: a[0], lambda pg, a: a[0], True)
_with_reduce_ops("reduce", dist.ReduceOptions, lambda a: a[0],
                 lambda pg, a: a[0] if a[-1].rootRank == pg.rank() else [], True)
_with_reduce_ops("reduce_scatter", ReduceScatterOptions, None, lambda pg, a: a[0], False)
_with_reduce_ops("_reduce_scatter_base", ReduceScatterOptions, None, lambda pg, a: [a[0]], False)


def _create(store, rank, size, timeout):
    return ProcessGroupHCCL(store, rank, size, timeout)


def register() -> None:
    """Registers `hccl` with torch.distributed for the npu device (idempotent)."""
    global _alias
    from . import data_parallel

    data_parallel.install()  # nn.DataParallel's copies between npu devices
    if not dist.is_available():
        return
    _alias = torch.ops.opennpu._npu_cpu_alias
    if "HCCL" in dist.Backend._plugins:
        return
    dist.Backend.register_backend("hccl", _create, devices=["npu"])
