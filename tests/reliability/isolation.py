"""Runs a function in a forked child with a time limit, so that a crash or a hang in native code
fails one test instead of killing (or stalling) the whole run.

The child runs single-threaded: OpenMP's thread pool does not survive fork, and at::parallel_for
with one thread never enters a parallel region.
"""

from __future__ import annotations

import os
import pickle
import resource
import select
import signal
import time

import torch


def _data_size_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def run_isolated(fn, timeout: float, memory_limit: int = 4 << 30) -> tuple[str, object]:
    """Calls fn() in a child process. Returns ("ok", value) with fn's (picklable) result,
    ("raised", text) when fn raised, ("crashed", text) when the child died on a signal or exited
    without a result, or ("hung", text) when it outlived `timeout` seconds (it is then killed).
    The child may allocate `memory_limit` bytes beyond what it inherits (RLIMIT_DATA), so a
    call that legitimately asks for terabytes fails in the allocator instead of the machine."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        try:
            limit = _data_size_bytes() + memory_limit
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
            torch.set_num_threads(1)
            payload = ("ok", fn())
        except BaseException as error:  # noqa: BLE001 (reported to the parent, whatever it is)
            payload = ("raised", f"{type(error).__name__}: {error}")
        try:
            data = pickle.dumps(payload)
        except Exception as error:  # noqa: BLE001
            data = pickle.dumps(("raised", f"unpicklable result: {error}"))
        view = memoryview(data)
        while view:
            view = view[os.write(write_end, view):]
        os.close(write_end)
        os._exit(0)

    os.close(write_end)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "hung", f"no result after {timeout:g} s (killed)"
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return "crashed", f"child killed by {sig}"
    if not chunks:
        return "crashed", f"child exited with status {os.waitstatus_to_exitcode(status)} and no result"
    return pickle.loads(b"".join(chunks))
