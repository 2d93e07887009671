"""torch.distributed's `hccl` backend on the emulated npu device (opennpu.distributed): two ranks
spawned as processes on loopback 127.0.0.1, each case bounded by a hard timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_hccl_worker.py")
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(case: str, tmp_path: Path, timeout: float = 60.0, env: dict | None = None) -> list:
    """Runs CASE on WORLD ranks; returns each rank's results (None where a rank wrote none). A
    port taken by another process between _free_port and the store's bind (tests run in parallel)
    gets one more try on a new port."""
    try:
        return _spawn_once(case, tmp_path, timeout, env or {})
    except AssertionError as error:
        if "address already in use" not in str(error).lower():
            raise
        return _spawn_once(case, tmp_path, timeout, env or {})


def _spawn_once(case: str, tmp_path: Path, timeout: float, extra_env: dict) -> list:
    port = str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", **extra_env)
    outs = [tmp_path / f"{case}.{r}.pt" for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), case, str(r), str(WORLD), port, str(outs[r])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    deadline = time.monotonic() + timeout
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.communicate()
            pytest.fail(f"{case}: rank {r} still running after {timeout} s")
        if p.returncode != 0:
            errors.append(f"rank {r} exited {p.returncode}:\n{err[-3000:]}")
    assert not errors, "\n".join(errors)
    return [torch.load(o, weights_only=False) if o.exists() else None for o in outs]


def test_collectives(tmp_path):
    r0, r1 = _spawn("collectives", tmp_path)
    for rank, res in enumerate((r0, r1)):
        eq = lambda name, *v: torch.testing.assert_close(res[name], torch.tensor(v), msg=name)  # noqa: E731
        assert res["backend"] == "hccl"
        eq("all_reduce_SUM", 3.0, 3.0)
        eq("all_reduce_PRODUCT", 2.0, 2.0)
        eq("all_reduce_MIN", 1.0, 1.0)
        eq("all_reduce_MAX", 2.0, 2.0)
        eq("all_reduce_BAND", 1 & 2, 6)
        eq("all_reduce_BOR", 1 | 2, 6)
        eq("all_reduce_BXOR", 1 ^ 2, 0)
        eq("broadcast", 0.0, 2.0, 4.0, 6.0)
        eq("all_gather", [0.0, 0.0], [1.0, 1.0])
        torch.testing.assert_close(res["all_gather_into_tensor"], torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
        eq("reduce_scatter_tensor", *[2.0 * (2 * rank + i) + 1 for i in range(2)])
        torch.testing.assert_close(res["all_gather_into_flat_tensor"], torch.tensor([0.0] * 6 + [1.0] * 6))
        torch.testing.assert_close(res["reduce_scatter_shaped_tensor"],
                                   torch.tensor([[2.0 * (2 * rank + i) + 1 for i in range(2)]]))
        eq("scatter", 20.0 + rank, 20.0 + rank)
        eq("all_to_all_single", rank, 10.0 + rank)
        eq("all_to_all", rank, 100.0 + rank)
        eq("batch_isend_irecv", 1.5 - rank, 1.5 - rank)
        assert res["async_completed"] is True
        eq("async", 2.0, 2.0)
        eq("new_group", 3.0, 3.0)
        assert res["new_group_backend"] == "hccl"
        assert res["zero_copy"] == (True, 0, 2.0)
    torch.testing.assert_close(r0["reduce"], torch.tensor([3.0, 3.0, 3.0]))
    torch.testing.assert_close(r0["gather"], torch.tensor([[10.0, 10.0], [11.0, 11.0]]))
    torch.testing.assert_close(r1["send_recv"], torch.tensor([7.0, 8.0]))


def test_reduce_ops_and_uneven(tmp_path):
    for rank, res in enumerate(_spawn("reduce_ops", tmp_path)):
        torch.testing.assert_close(res["avg"], torch.tensor([1.5, 1.5]))
        torch.testing.assert_close(res["avg_int"], torch.tensor([1, 2], dtype=torch.int32))  # (1+2)//2, (1+3)//2
        torch.testing.assert_close(res["premul"], torch.tensor([6.0]))  # 2 * (1 + 2)
        torch.testing.assert_close(res["reduce_scatter_avg"], torch.tensor([0.0, 1.5]) if rank == 0 else torch.tensor([3.0, 4.5]))
        torch.testing.assert_close(res["reduce_scatter_uneven"], torch.tensor([0.0]) if rank == 0 else torch.tensor([2.0, 4.0]))
        torch.testing.assert_close(res["all_gather_uneven"], torch.tensor([5.0, 6.0, 6.0]))
        torch.testing.assert_close(res["all_gather_shapes"], [torch.ones(2, 3), torch.full((4,), 2.0)])


def test_futures_hold_npu_tensors(tmp_path):
    for rank, res in enumerate(_spawn("futures", tmp_path)):
        for mode in ("1", "sync", "0"):
            assert res[f"value_{mode}"] == [(f"npu:{rank}", True)], mode
            device, doubled = res[f"then_{mode}"]
            assert device == f"npu:{rank}", mode
            torch.testing.assert_close(doubled, torch.full((3,), 6.0))
            torch.testing.assert_close(res[f"broadcast_{mode}"], torch.full((2,), 2.0))
            # Linear(4, 2) on rows of (rank + 1): d(sum)/dW = 3 * (rank + 1) per entry, averaged.
            device, grad = res[f"ddp_hook_{mode}"]
            assert device == f"npu:{rank}", mode
            torch.testing.assert_close(grad, torch.full((2, 4), 4.5))


def test_default_backend_and_device_map(tmp_path):
    for res in _spawn("default_backend", tmp_path):
        for spec in ("None", "cpu:gloo,npu:hccl"):
            backend, t, c = res[spec]
            torch.testing.assert_close(t, torch.tensor([3.0, 3.0]))
            torch.testing.assert_close(c, torch.tensor([3.0, 3.0]))
        assert res["None"][0] == "npu:hccl"  # the accelerator's backend, as CUDA gets nccl
        assert res["cpu:gloo,npu:hccl"][0] == "cpu:gloo,npu:hccl"


def test_ddp_matches_gloo_on_cpu(tmp_path):
    for res in _spawn("ddp", tmp_path):
        npu, cpu = res["npu"], res["cpu"]
        assert npu["losses"] == cpu["losses"]
        for gn, gc in zip(npu["grads"], cpu["grads"]):
            for a, b in zip(gn, gc):
                assert torch.equal(a, b)
        for a, b in zip(npu["params"], cpu["params"]):
            assert torch.equal(a, b)


def test_fsdp2_matches_one_process(tmp_path):
    for res in _spawn("fsdp2", tmp_path):
        for loss, ref in res["losses"]:
            assert abs(loss - ref) <= 1e-6 * abs(ref)
        for name, ref in res["ref"].items():
            torch.testing.assert_close(res["params"][name], ref, rtol=1e-6, atol=1e-6)


def test_torchrun(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           str(WORKER), "torchrun", str(tmp_path / "torchrun")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"torchrun.{rank}.pt")
        torch.testing.assert_close(res["sum"], torch.full((3,), 3.0))
        assert res["device"] == f"npu:{rank}"
        assert res["config"] == "npu:hccl"


@pytest.mark.parametrize("hosts", ["one", "apart"])
@pytest.mark.parametrize("mode", ["1", "sync"])
def test_mismatched_collectives_raise(tmp_path, mode, hosts):
    """The check deferred (the default) and in the caller (OPENNPU_HCCL_CHECK=sync); fingerprints
    exchanged in shared memory (ranks on one host) and through gloo (ranks on different hosts)."""
    env = {"OPENNPU_HCCL_CHECK": mode, "TEST_HOSTS_APART": "1" if hosts == "apart" else "0"}
    for res in _spawn("mismatch", tmp_path, env=env):
        assert res["same_host_rendezvous"] == (hosts == "one")
        for what, expected in (("shape", ("4 elements", "5 elements")), ("dtype", ("float32", "float64")),
                               ("op", ("allreduce", "broadcast"))):
            assert res[what] is not None and "mismatched collectives" in res[what], (what, res[what])
            assert all(e in res[what] for e in expected), res[what]
        torch.testing.assert_close(res["after"], torch.full((2,), 2.0))


def test_dead_peer_raises_within_timeout(tmp_path):
    r0, _ = _spawn("peer_dies", tmp_path)
    assert r0["error"] is not None, "rank 0's collective returned though its peer died"
    assert r0["seconds"] < 20


def test_group_created_again_on_the_same_store(tmp_path):
    for res in _spawn("reinit", tmp_path):
        for round_ in range(2):
            torch.testing.assert_close(res[f"sum{round_}"], torch.full((3,), 1.0 + 2 * round_))
            assert res[f"rendezvous{round_}"]
            assert "mismatched collectives" in (res[f"mismatch{round_}"] or ""), res


@pytest.mark.parametrize("hosts", ["one", "apart"])
def test_silent_peer_times_out(tmp_path, hosts):
    r0, _ = _spawn("peer_silent", tmp_path, env={"TEST_HOSTS_APART": "1" if hosts == "apart" else "0"})
    assert r0["error"] is not None, "rank 0's collective returned though its peer never joined"
    assert r0["seconds"] < 10
    assert "Timed out" in r0["error"], r0["error"]


def test_hccl_env_variables(tmp_path):
    """HCCL_EXEC_TIMEOUT bounds each collective (no timeout= given), HCCL_SOCKET_IFNAME picks
    gloo's interface, HCCL_CONNECT_TIMEOUT is accepted."""
    env = {"HCCL_EXEC_TIMEOUT": "2", "HCCL_CONNECT_TIMEOUT": "30", "HCCL_SOCKET_IFNAME": "lo",
           "HCCL_WHITELIST_DISABLE": "1", "HCCL_BUFFSIZE": "200"}
    r0, _ = _spawn("hccl_env", tmp_path, env=env)
    torch.testing.assert_close(r0["sum"], torch.full((4,), 2.0))
    assert r0["error"] is not None and "Timed out" in r0["error"], r0["error"]
    assert r0["seconds"] < 7


def test_torchrun_two_nodes(tmp_path):
    """The multi-machine command line, both "machines" on this host: two torchrun invocations
    with --nnodes 2 --node_rank R --master_addr --master_port, one npu rank each."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--node_rank", str(node), "--nproc_per_node", "1",
                               "--master_addr", "127.0.0.1", "--master_port", port,
                               str(WORKER), "torchrun", str(tmp_path / "nodes")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in range(2)]
    try:
        errs = [p.communicate(timeout=90)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    for rank in range(2):
        res = torch.load(tmp_path / f"nodes.{rank}.pt")
        torch.testing.assert_close(res["sum"], torch.full((3,), 3.0))
        assert res["config"] == "npu:hccl"
