"""The same-host rendezvous behind hccl's cross-rank check (csrc/distributed/hccl_rendezvous.cpp),
driven in one process: two handles on one file play two ranks."""

import threading

import pytest
import torch
import torch.distributed as dist

import opennpu  # noqa: F401

ops = torch.ops.opennpu
FP = 4


@pytest.fixture
def ranks(tmp_path):
    path = str(tmp_path / "rendezvous")
    r0 = ops._hccl_rendezvous_open(path, 2, 0, FP, True)
    r1 = ops._hccl_rendezvous_open(path, 2, 1, FP, False)
    yield r0, r1
    ops._hccl_rendezvous_close(r0)
    ops._hccl_rendezvous_close(r1)


def test_exchange_in_order(ranks):
    r0, r1 = ranks
    for step in range(3):  # parity buffers: numbers 1, 2, 3
        n0 = ops._hccl_rendezvous_publish(r0, [step, 1, 2, 3])
        assert ops._hccl_rendezvous_collect(r0, n0, 0.0) == []  # rank 1 has not published
        n1 = ops._hccl_rendezvous_publish(r1, [step, 9, 9, 9])
        assert n0 == n1 == step + 1
        expected = [step, 1, 2, 3, step, 9, 9, 9]
        assert ops._hccl_rendezvous_collect(r1, n1, 0.0) == expected
        assert ops._hccl_rendezvous_collect(r0, n0, 5.0) == expected


def test_waiter_wakes_when_the_last_rank_publishes(ranks):
    r0, r1 = ranks
    got = []
    n0 = ops._hccl_rendezvous_publish(r0, [1] * FP)
    waiter = threading.Thread(target=lambda: got.append(ops._hccl_rendezvous_collect(r0, n0, 30.0)))
    waiter.start()  # sleeps on the futex (the GIL released)
    n1 = ops._hccl_rendezvous_publish(r1, [2] * FP)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert got == [[1] * FP + [2] * FP]
    assert ops._hccl_rendezvous_collect(r1, n1, 0.0) == [1] * FP + [2] * FP


def test_timeout_names_the_missing_rank(ranks):
    r0, _ = ranks
    n = ops._hccl_rendezvous_publish(r0, [0] * FP)
    with pytest.raises(dist.DistBackendError, match=r"Timed out after 0.2 s waiting for rank\(s\) 1 to reach collective number 1"):
        ops._hccl_rendezvous_collect(r0, n, 0.2)


def test_misuse_is_an_error(ranks, tmp_path):
    r0, _ = ranks
    with pytest.raises(RuntimeError, match="expected a fingerprint of 4 values, got 3"):
        ops._hccl_rendezvous_publish(r0, [1, 2, 3])
    n = ops._hccl_rendezvous_publish(r0, [0] * FP)
    with pytest.raises(RuntimeError, match="published but not collected"):
        ops._hccl_rendezvous_publish(r0, [0] * FP)
    with pytest.raises(RuntimeError, match="is not the one awaiting collection"):
        ops._hccl_rendezvous_collect(r0, n + 1, 0.0)
    with pytest.raises(RuntimeError, match="cannot open the rendezvous file"):
        ops._hccl_rendezvous_open(str(tmp_path / "absent"), 2, 1, FP, False)
    with pytest.raises(RuntimeError, match="no open rendezvous with handle"):
        ops._hccl_rendezvous_publish(10**6, [0] * FP)
