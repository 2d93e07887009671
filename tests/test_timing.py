"""The benchmark harness's interleaved timer: every function runs in alternation, enough times."""

from __future__ import annotations

from opennpu.testing.timing import time_interleaved


def test_time_interleaved_runs_every_function_in_alternation():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("ours", "eager", "compile")}
    times = time_interleaved(fns, threads=1, min_run_time=0.0, min_samples=4, block_time=0.0)
    assert set(times) == set(fns)
    for t in times.values():
        assert 0 < t["p20"] <= t["median"] <= t["p80"]
    # one calibration call each, then blocks of one call: 4 rounds, each visiting all three once
    timed = calls[3:]
    assert len(timed) == 12 and all(sorted(timed[i:i + 3]) == sorted(fns) for i in range(0, 12, 3))
    assert timed[:3] != timed[3:6]  # the order rotates between rounds


def test_measure_roofs_reports_both_copies():
    from opennpu.testing.timing import measure_roofs

    roofs = measure_roofs(threads=1, nbytes=1 << 20, min_run_time=0.0)
    assert set(roofs) == {"copy", "stream"} and all(gbps > 0 for gbps in roofs.values())
