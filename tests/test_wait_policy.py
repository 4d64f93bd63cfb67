"""The OpenMP wait policy npllm.kernels picks at import: brief spinning on a machine with a core free for each
thread, sleeping otherwise, and whatever the environment says when it says something."""

import os
import subprocess
import sys
import time

import pytest

from npllm import kernels


@pytest.fixture
def machine(monkeypatch):
    """A machine of 2 cores with a settable count of tasks busy elsewhere and a clean environment (a plain dict, so
    that what _choose_wait_policy writes is thrown away)."""
    state = {"load": 0.0}
    monkeypatch.setattr(os, "environ", {})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(kernels, "_busy_elsewhere", lambda: state["load"])
    return state


def policy_variables() -> dict:
    """The environment without pytest's own variables."""
    return {k: v for k, v in os.environ.items() if k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


@pytest.mark.parametrize("load, spins", [(0.0, True), (0.5, True), (0.6, False), (1.0, False), (3.0, False)])
def test_threads_spin_only_with_a_core_free_for_each(machine, load, spins):
    machine["load"] = load
    assert kernels._choose_wait_policy() is spins
    if spins:
        assert policy_variables() == {"GOMP_SPINCOUNT": str(kernels.SPIN_COUNT)}
    else:
        assert policy_variables() == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_fewer_threads_leave_room_for_the_load(machine):
    machine["load"] = 1.0
    os.environ["NUMBA_NUM_THREADS"] = "1"
    assert kernels._choose_wait_policy() is True


@pytest.mark.parametrize("env, spins", [({"OMP_WAIT_POLICY": "PASSIVE"}, False), ({"OMP_WAIT_POLICY": "active"}, True),
                                        ({"GOMP_SPINCOUNT": "0"}, False), ({"GOMP_SPINCOUNT": "10000"}, True),
                                        ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "100"}, True)])
def test_the_environment_wins(machine, env, spins):
    machine["load"] = 0.0 if not spins else 9.0  # the load average would have said the opposite
    os.environ.update(env)
    assert kernels._choose_wait_policy() is spins
    assert policy_variables() == env


def test_no_load_average_means_sleep(machine, monkeypatch):
    def unavailable():
        raise OSError("no load average")

    monkeypatch.setattr(kernels, "_busy_elsewhere", unavailable)
    assert kernels._choose_wait_policy() is False


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="counts tasks through /proc")
def test_a_busy_neighbour_is_counted():
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert kernels._busy_elsewhere() >= 1
    finally:
        neighbour.kill()
        neighbour.wait()


def test_a_machine_without_proc_or_load_average_sleeps(monkeypatch):
    """Windows has neither /proc/loadavg nor os.getloadavg: the import must not fail, and the threads sleep."""
    monkeypatch.setattr(os, "environ", {})
    monkeypatch.delattr(os, "getloadavg", raising=False)
    real_open = open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_proc)
    assert kernels._choose_wait_policy() is False
    assert policy_variables() == {"OMP_WAIT_POLICY": "PASSIVE"}
