"""CPU_AFFINITY_CONF core binding (csrc/device/npu_affinity.cpp) and torch_npu.utils'
set_thread_affinity / reset_thread_affinity. Each case runs in a fresh interpreter: the
configuration is read once per process, and binding changes the process's threads."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch_npu

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs this process may use")

# Prints, as JSON, each named thread's allowed CPUs after a forward/backward on `device`, the
# name of the thread that ran the backward ("main": the caller), and whether multithreaded
# backward was on for the caller (after its forward; {multithreading}: what the script sets then).
PROBE = textwrap.dedent("""
    import json, os, sys, threading, time, torch, torch_npu
    torch.set_num_threads(1)
    if {set_device} is not None:
        torch.npu.set_device({set_device})
    device = torch.device("npu", {device})
    model = torch.nn.Linear(8, 8).to(device)
    out = model(torch.randn(4, 8, device=device))
    if {multithreading} is not None:
        torch._C._set_multithreading_enabled({multithreading})
    multithreading = torch.autograd.is_multithreading_enabled()
    ran = []
    out.register_hook(lambda g: ran.append(threading.get_native_id()))
    out.sum().backward()

    def named_threads():
        threads = {{}}
        for tid in os.listdir("/proc/self/task"):
            try:
                name = open(f"/proc/self/task/{{tid}}/comm").read().strip()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            threads[name if int(tid) != os.getpid() else "main"] = sorted(os.sched_getaffinity(int(tid)))
        return threads

    # The engine starts its device threads with the first backward; each names itself once
    # running, which may come after the backward returned: wait (bounded) for both names.
    deadline = time.monotonic() + 10
    threads = named_threads()
    while not {{"pt_autograd_0", "pt_autograd_1"}} <= threads.keys() and time.monotonic() < deadline:
        time.sleep(0.01)
        threads = named_threads()
    backward = "main" if ran[0] == os.getpid() else open(f"/proc/self/task/{{ran[0]}}/comm").read().strip()
    print(json.dumps({{"threads": threads, "backward": backward, "multithreading": multithreading}}))
""")


def _run(script: str, conf: str | None, **fmt) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_AFFINITY_CONF", "ASCEND_RT_VISIBLE_DEVICES")}
    env["OPENNPU_DEVICE_COUNT"] = "2"
    if conf is not None:
        env["CPU_AFFINITY_CONF"] = conf
    return subprocess.run([sys.executable, "-c", script.format(**fmt) if fmt else script], capture_output=True, text=True,
                          env=env, timeout=120)


def _probe(conf: str | None, set_device, device, multithreading=None) -> dict:
    result = _run(PROBE, conf, set_device=set_device, device=device, multithreading=multithreading)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _threads(conf: str | None, set_device, device) -> dict:
    return _probe(conf, set_device, device)["threads"]


def test_without_conf_the_backward_runs_in_the_callers_thread():
    probe = _probe(None, 1, 1)
    assert probe["backward"] == "main" and probe["multithreading"] is False
    threads = probe["threads"]
    assert threads["main"] == CPUS
    assert threads["pt_autograd_1"] == CPUS and threads["pt_autograd_0"] == CPUS  # never ran a kernel


def test_with_multithreading_turned_back_on_the_engine_thread_moves_to_its_callers_cpu():
    probe = _probe(None, 1, 1, multithreading=True)
    assert probe["backward"] == "pt_autograd_1" and probe["multithreading"] is True
    threads = probe["threads"]
    assert threads["main"] == CPUS
    # The engine's npu:1 thread ran the backward on the CPU the forward's thread last ran on.
    assert len(threads["pt_autograd_1"]) == 1 and threads["pt_autograd_1"][0] in CPUS
    assert threads["pt_autograd_0"] == CPUS  # never ran a kernel


def test_backward_follows_caller_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("OPENNPU_BACKWARD_FOLLOWS_CALLER", "0")
    probe = _probe(None, 1, 1)
    assert probe["backward"] == "pt_autograd_1" and probe["multithreading"] is True
    assert probe["threads"]["main"] == CPUS and probe["threads"]["pt_autograd_1"] == CPUS


@two_cpus
def test_mode1_binds_set_device_caller_and_the_autograd_thread_of_each_device():
    a, b = CPUS[0], CPUS[1]
    # The main thread sets npu:0 (bound to a) and trains on npu:1: the autograd engine's npu:1
    # thread runs npu:1's backward kernels and is bound to npu:1's range (b) by its first kernel.
    threads = _threads(f"1,npu0:{a}-{a},npu1:{b}-{b}", 0, 1)
    assert threads["main"] == [a]
    assert threads["pt_autograd_1"] == [b]


@two_cpus
def test_default_ranges_split_the_process_cpus_over_the_devices():
    threads = _threads("1", 1, 1)
    # 2 devices: device 1 gets the upper half of the CPUs (or CPU 1 mod #CPUs with fewer CPUs).
    half = len(CPUS) // 2
    assert threads["main"] == CPUS[half:]
    assert threads["pt_autograd_1"] == CPUS[half:]


@two_cpus
def test_mode2_pins_a_single_threaded_worker_to_the_first_core_of_its_range():
    a, b = CPUS[0], CPUS[1]
    threads = _threads(f"2,npu1:{a}-{b}", 1, 1)
    assert threads["main"] == [a]


def test_range_outside_the_process_cpus_is_skipped_with_a_warning():
    outside = max(CPUS) + 1
    result = _run(PROBE, f"1,npu1:{outside}-{outside}", set_device=1, device=1, multithreading=None)
    assert result.returncode == 0, result.stderr
    assert "may not run on" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["threads"]["main"] == CPUS


@pytest.mark.parametrize("conf", ["3", "1,npu0:5-2"])
def test_malformed_config_warns_and_binds_nothing(conf):
    result = _run(PROBE, conf, set_device=1, device=1, multithreading=None)
    assert result.returncode == 0, result.stderr
    assert "CPU_AFFINITY_CONF=" in result.stderr and "no core binding" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["threads"]["main"] == CPUS


@two_cpus
def test_set_and_reset_thread_affinity_for_a_child_thread():
    a, b = CPUS[0], CPUS[1]
    script = textwrap.dedent(f"""
        import os, threading, torch, torch_npu
        torch.npu.set_device(0)
        seen = {{}}
        torch_npu.utils.set_thread_affinity([{b}, {b}])
        child = threading.Thread(target=lambda: seen.update(child=sorted(os.sched_getaffinity(0))))
        child.start()
        torch_npu.utils.reset_thread_affinity()
        child.join()
        print(seen["child"], sorted(os.sched_getaffinity(0)))
    """)
    result = _run(script, f"1,npu0:{a}-{a}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"[{b}] [{a}]"


def test_thread_affinity_calls_do_nothing_while_binding_is_off():
    before = sorted(os.sched_getaffinity(0))
    torch_npu.utils.set_thread_affinity([CPUS[0], CPUS[0]])
    torch_npu.utils.reset_thread_affinity()
    assert sorted(os.sched_getaffinity(0)) == before


@pytest.mark.parametrize("bad", [[1, 2, 3], [], [-1, 5], [2, -3], [[2, 1]], "0-1"])
def test_set_thread_affinity_rejects_bad_ranges(bad):
    with pytest.raises(ValueError, match="Invalid core range"):
        torch_npu.utils.set_thread_affinity(bad)
