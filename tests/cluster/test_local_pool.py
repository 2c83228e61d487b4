"""The local trial pool (simulated and replayed trials in worker processes, no Ray) keeps the
TrialPool contract: a trial's failure is its result, a worker that dies is a ``crashed`` trial and
loses no finished one, an infrastructure failure is re-run, and no worker outlives the pool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _ray_helpers import wait_all

from servetune.cluster import LocalPool, pool_kind, start_pool
from servetune.engines import TrialTask
from servetune.errors import SpecError
from servetune.result import TrialResult, TrialStatus
from servetune.workload import Workload

TASK = TrialTask(model="servetune-test-850m", gpu="H200", flags={"gpu_memory_utilization": 0.5, "max_num_seqs": 16},
                 workload=Workload.from_dict({"input_len": 128, "output_len": 16, "num_requests": 8,
                                              "concurrency": 4}))


def _task(log_dir: Path, seed: int = 0) -> TrialTask:
    return TrialTask(**{**TASK.__dict__, "log_dir": str(log_dir), "seed": seed})


def _pid_runner(task: TrialTask, backend: str) -> TrialResult:
    """Writes its worker's pid into the task's folder; seed 1 sleeps (a long trial), seed 2 kills
    its own worker, seed 3 fails for the machine's reasons on its first attempt."""
    folder = Path(task.log_dir or ".")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"pid-{os.getpid()}").write_text("")
    if task.seed == 1:
        time.sleep(60)
    if task.seed == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if task.seed == 3 and not (folder / "attempted").exists():
        (folder / "attempted").write_text("")
        return TrialResult(TrialStatus.INFRA_ERROR, backend=backend, infrastructure="port_in_use",
                           cause="infrastructure failure: address already in use")
    return TrialResult(TrialStatus.OK, backend=backend, output_throughput=float(task.seed),
                       evidence=[f"pid={os.getpid()}"])


def _pids(folder: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in folder.glob("pid-*")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie no one reaped yet has ended too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def pool() -> Iterator[LocalPool]:
    pool = LocalPool.start(num_gpus=2, runner=_pid_runner)
    yield pool
    pool.cancel_all()


def test_the_default_runner_simulates_in_a_worker_and_records_its_slot(tmp_path: Path) -> None:
    pool = LocalPool.start(num_gpus=2)
    try:
        pool.submit(0, _task(tmp_path / "t0"), "sim", gpus=1)
        assert (pool.free_gpus, pool.running) == (1, [0])
        result = wait_all(pool, 1, 60.0)[0]
    finally:
        pool.close()
    assert result.status is TrialStatus.OK and result.output_throughput and result.output_throughput > 0
    assert result.gpu_ids == ["0"] and "local_gpu_ids=['0']" in result.evidence
    assert result.dispatch_s is not None and result.dispatch_s > 0
    assert pool.free_gpus == 2 and pool.running == []


def test_a_clean_worker_runs_the_next_trial_and_close_ends_it(pool: LocalPool, tmp_path: Path) -> None:
    pool.submit(0, _task(tmp_path), "sim", gpus=1)
    wait_all(pool, 1, 60.0)
    pool.submit(1, _task(tmp_path, seed=0), "sim", gpus=2)  # another size: slots are only a count
    assert pool.free_gpus == 0
    result = wait_all(pool, 1, 60.0)[1]
    assert sorted(result.gpu_ids) == ["0", "1"]
    pids = _pids(tmp_path)
    assert len(pids) == 1, f"the second trial started a new worker: {pids}"
    pool.close()
    deadline = time.monotonic() + 10
    while _alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids[0]), "the idle worker outlived close()"


def test_a_killed_worker_is_a_crashed_trial_and_the_finished_ones_are_kept(pool: LocalPool, tmp_path: Path) -> None:
    pool.submit(0, _task(tmp_path / "ok"), "sim", gpus=1)
    first = wait_all(pool, 1, 60.0)[0]
    assert first.status is TrialStatus.OK
    pool.submit(1, _task(tmp_path / "dies", seed=2), "sim", gpus=1)
    pool.submit(2, _task(tmp_path / "ok2"), "sim", gpus=1)
    done = wait_all(pool, 2, 60.0)
    assert done[1].status is TrialStatus.CRASHED and "killed by SIGKILL" in (done[1].cause or "")
    assert done[2].status is TrialStatus.OK
    assert pool.free_gpus == 2
    pool.submit(3, _task(tmp_path / "after"), "sim", gpus=1)  # the pool goes on with a fresh worker
    assert wait_all(pool, 1, 60.0)[3].status is TrialStatus.OK


def test_an_infrastructure_failure_is_run_again_in_a_fresh_worker(pool: LocalPool, tmp_path: Path) -> None:
    pool.submit(5, _task(tmp_path, seed=3), "sim", gpus=1)
    result = wait_all(pool, 1, 60.0)[5]
    assert result.status is TrialStatus.OK
    assert len(result.infra_attempts) == 1 and "port_in_use" in result.infra_attempts[0]
    assert pool.infra_notes and pool.infra_notes[0].startswith("trial #5: attempt 1")
    assert len(set(_pids(tmp_path))) == 2  # the failed attempt's worker was not reused


def test_cancel_all_kills_the_running_workers(pool: LocalPool, tmp_path: Path) -> None:
    pool.submit(0, _task(tmp_path / "a", seed=1), "sim", gpus=1)
    pool.submit(1, _task(tmp_path / "b", seed=1), "sim", gpus=1)
    deadline = time.monotonic() + 30
    while len(_pids(tmp_path / "a") + _pids(tmp_path / "b")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = _pids(tmp_path / "a") + _pids(tmp_path / "b")
    assert len(pids) == 2
    assert sorted(pool.cancel_all()) == [0, 1]
    assert pool.running == [] and pool.free_gpus == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a cancelled trial's worker still runs"


def test_the_pool_for_a_study_is_local_for_simulated_trials_unless_ray_is_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The choice itself (pure): auto is local for sim and replay, Ray for real trials and wherever
    # a cluster is named or a Ray already runs in the process (another test's, here, possibly).
    assert pool_kind("sim", ray_address=None, ray_running=False, asked=None) == "local"
    assert pool_kind("replay", ray_address=None, ray_running=False, asked=None) == "local"
    assert pool_kind("vllm", ray_address=None, ray_running=False, asked=None) == "ray"
    assert pool_kind("sim", ray_address=None, ray_running=False, asked="ray") == "ray"
    assert pool_kind("sim", ray_address=None, ray_running=True, asked=None) == "ray"
    assert pool_kind("sim", ray_address="127.0.0.1:6379", ray_running=False, asked="local") == "local"
    monkeypatch.setenv("SERVETUNE_POOL", "local")  # start_pool reads the setting
    pool = start_pool("sim", num_gpus=2)
    assert isinstance(pool, LocalPool) and not pool.started_local_ray and pool.total_gpus == 2
    monkeypatch.setenv("SERVETUNE_POOL", "rays")
    with pytest.raises(SpecError, match="SERVETUNE_POOL: unknown pool 'rays'"):
        start_pool("sim", num_gpus=2)


def test_an_idle_worker_exits_when_its_driver_is_killed_outright(tmp_path: Path) -> None:
    """A SIGKILLed driver runs no cleanup: its idle worker sees the task pipe close and exits."""
    code = ("import sys, time; from pathlib import Path; from servetune.cluster import LocalPool;"
            "from _ray_helpers import wait_all; from test_local_pool import _pid_runner, _task;"
            "pool = LocalPool.start(num_gpus=1, runner=_pid_runner);"
            f"pool.submit(0, _task(Path({str(tmp_path)!r})), 'sim', gpus=1); wait_all(pool, 1, 60.0);"
            "print('ready', flush=True); time.sleep(120)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "ready"
        pids = _pids(tmp_path)
        assert len(pids) == 1 and _alive(pids[0])
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pids[0]), "the worker outlived its SIGKILLed driver"
    finally:
        driver.kill()
