"""The Ray trial pool on a real local Ray with two logical GPUs.

A trial's actor records the GPUs Ray gave it; a trial whose result says its GPU memory did not
come back (``quarantined_gpus``) takes its slot out of service: Ray never places another trial
there, the pool plans with fewer GPUs and lists the lost ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from servetune.cluster.pool import TrialPool
from servetune.engines import TrialTask
from servetune.result import TrialResult, TrialStatus
from servetune.workload import Workload
from _ray_helpers import wait_all

TASK = TrialTask(model="servetune-test-850m", gpu="H200", flags={"gpu_memory_utilization": 0.5, "max_num_seqs": 16},
                 workload=Workload.from_dict({"input_len": 128, "output_len": 16, "num_requests": 8,
                                              "concurrency": 4}))


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    if ray.is_initialized():  # another test's cluster may have a different GPU count
        ray.shutdown()
    yield
    TrialPool.shutdown()



def _available_gpus(expected: float, timeout_s: float = 30.0) -> float:
    """Ray's free GPUs once they settle at ``expected`` (``ray.kill`` releases them asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0.0) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return ray.available_resources().get("GPU", 0.0)


def test_a_probe_answers_from_a_gpu_node_before_any_trial_and_holds_no_gpu(local_ray: None) -> None:
    """What the study driver asks a GPU worker before its first trial (vLLM's has_flashinfer() there, which decides
    the FlashInfer all-reduce fusion workspace its plans charge): answered, or None when the question fails or does
    not answer in time; either way its actor ends and gives its sliver of a GPU back."""
    import importlib.util

    from servetune.engines.vllm.host import probe_has_flashinfer

    def broken() -> bool:
        raise RuntimeError("no answer")

    def stuck() -> bool:
        time.sleep(600)
        return True

    pool = TrialPool.start(num_gpus=2, num_cpus=2)
    assert pool.on_worker(probe_has_flashinfer, "H200") is (importlib.util.find_spec("flashinfer") is not None)
    assert pool.on_worker(broken, "H200", timeout_s=30.0) is None
    started = time.monotonic()
    assert pool.on_worker(stuck, "H200", timeout_s=3.0) is None  # given up, and its actor (and GPU sliver) ended
    assert time.monotonic() - started < 30
    assert _available_gpus(2) == 2 and pool.free_gpus == 2


def test_a_trial_records_its_gpus_and_a_quarantined_slot_leaves_service(local_ray: None) -> None:
    def runner(task: TrialTask, backend: str) -> TrialResult:
        # The trial with seed 1 leaves its GPU memory behind, as a leaked vLLM EngineCore does.
        result = TrialResult(TrialStatus.OK, backend=backend, output_throughput=1.0)
        if task.seed == 1:
            result.quarantined_gpus = [str(g) for g in ray.get_gpu_ids()]
        return result

    pool = TrialPool.start(num_gpus=2, num_cpus=2, runner=runner)
    assert (pool.total_gpus, pool.free_gpus, pool.quarantined) == (2, 2, [])

    pool.submit(0, TASK, "sim", gpus=1)  # a normal trial: its GPU goes back to Ray
    first = wait_all(pool, 1, 120.0)[0]
    assert len(first.gpu_ids) == 1 and "ray_gpu_ids=" in " ".join(first.evidence)
    assert pool.total_gpus == 2 and _available_gpus(2) == 2

    pool.submit(1, TrialTask(**{**TASK.__dict__, "seed": 1}), "sim", gpus=1)
    bad = wait_all(pool, 1, 120.0)[1]
    assert bad.quarantined_gpus == bad.gpu_ids and len(bad.gpu_ids) == 1
    assert pool.quarantined == bad.gpu_ids
    assert (pool.total_gpus, pool.cluster_gpus, pool.free_gpus) == (1, 2, 1)
    assert pool.quarantine_notes and f"trial 1: GPU(s) {bad.gpu_ids[0]} out of service" in pool.quarantine_notes[0]
    assert _available_gpus(1) == 1  # the held actor keeps the slot from Ray

    # Every later trial lands on the GPU that is left, never on the quarantined one.
    for n in (2, 3):
        pool.submit(n, TASK, "sim", gpus=1)
    later = wait_all(pool, 2, 120.0)
    assert all(r.gpu_ids and r.gpu_ids[0] not in pool.quarantined for r in later.values())
    assert pool.free_gpus == 1 and pool.running == []

    assert pool.release_quarantined() == bad.gpu_ids
    assert (pool.total_gpus, pool.quarantined) == (2, [])
    assert _available_gpus(2) == 2


def test_the_default_runner_runs_the_sim_engine_in_the_actor(local_ray: None) -> None:
    pool = TrialPool.start(num_gpus=2, num_cpus=2)
    pool.submit(5, TASK, "sim", gpus=2)
    result = wait_all(pool, 1, 120.0)[5]
    assert result.status is TrialStatus.OK and result.completed == 8
    assert len(result.gpu_ids) == 2 and result.quarantined_gpus == []


def test_a_killed_trial_actor_is_a_crashed_trial_its_gpus_come_back_and_the_pool_goes_on(local_ray: None) -> None:
    """A trial's Ray actor killed from outside (an operator's `ray kill`, an OOM killer): the trial
    is `crashed` with Ray's error as its cause, its GPU returns to Ray, and the next trial runs."""
    import dataclasses

    def runner(task: TrialTask, backend: str) -> TrialResult:
        if task.seed == 1:
            time.sleep(60)  # killed long before this ends
        return TrialResult(TrialStatus.OK, backend=backend, output_throughput=1.0)

    pool = TrialPool.start(num_gpus=2, num_cpus=2, runner=runner)  # the module's Ray has 2 logical GPUs
    total = ray.cluster_resources().get("GPU", 0.0)
    pool.submit(0, dataclasses.replace(TASK, seed=1), "sim", gpus=1)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0.0) != total - 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # the actor holds its GPU: it is running
    actor = next(item.actor for item in pool._running.values())
    ray.kill(actor, no_restart=True)
    result = wait_all(pool, 1, 120.0)[0]
    assert result.status is TrialStatus.CRASHED and "ActorDiedError" in (result.cause or "")
    assert _available_gpus(total) == total and pool.free_gpus == pool.total_gpus
    pool.submit(1, dataclasses.replace(TASK, seed=2), "sim", gpus=1)
    after = wait_all(pool, 1, 120.0)[1]
    assert after.status is TrialStatus.OK
    # The driver's view: hand-over to Ray until the result is back, and the actor's start within it.
    assert after.dispatch_s is not None and 0.0 <= after.timings_s["actor_start"] <= after.dispatch_s


def test_a_dead_worker_on_a_live_node_waits_for_rays_health_check_then_is_a_crash(
        local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial's worker process killed while Ray lists its node alive: a dying machine's worker can be reported
    before its raylet's missed health checks, so the trial is not told at once; it stays running until the
    health-check window has passed (here 1 x 3 s + 1 s), then, the node still alive, it is the trial's crash."""
    import dataclasses
    import os
    import signal

    monkeypatch.setenv("RAY_health_check_period_ms", "3000")
    monkeypatch.setenv("RAY_health_check_timeout_ms", "1000")
    monkeypatch.setenv("RAY_health_check_failure_threshold", "1")
    pid_file = tmp_path / "actor.pid"

    def runner(task: TrialTask, backend: str) -> TrialResult:  # nested: Ray pickles it by value
        import os as _os
        import time as _time
        from pathlib import Path as _Path

        _Path(str(pid_file)).write_text(str(_os.getpid()))
        _time.sleep(60)  # killed long before this ends
        return TrialResult(TrialStatus.OK, backend=backend)

    pool = TrialPool.start(num_gpus=2, num_cpus=2, runner=runner)
    pool.submit(0, dataclasses.replace(TASK, seed=3), "sim", gpus=1)
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the trial never started"
        time.sleep(0.1)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    seen: list[tuple[int, TrialResult]] = []
    while not seen and time.monotonic() < deadline and pool.running == [0]:
        seen = pool.wait(0.5)
        if not seen and not pool._running:  # Ray has reported the death: the pool holds it until the window ends
            break
    assert seen == [] and pool.running == [0] and pool.busy_gpus == 1, seen
    result = wait_all(pool, 1, 60.0)[0]
    assert result.status is TrialStatus.CRASHED and "worker process has died" in (result.cause or ""), result.cause
    assert pool.running == [] and _available_gpus(2) == 2


def test_a_clean_trials_actor_runs_the_next_trial_of_its_size_and_gives_its_gpus_back(local_ray: None) -> None:
    """With reuse on (as the study driver runs it), the next trial of the same GPU count runs in
    the same actor process (no new Ray worker to start); a trial of another size gets a fresh actor
    with the idle one's GPUs, and close() gives every GPU back to Ray."""
    import dataclasses

    def pid_runner(task: TrialTask, backend: str) -> TrialResult:  # nested: Ray pickles it by value
        import os

        return TrialResult(TrialStatus.OK, backend=backend, output_throughput=1.0, evidence=[f"pid={os.getpid()}"])

    pool = TrialPool.start(num_gpus=2, num_cpus=2, runner=pid_runner)
    pool.reuse_actors = True
    total = ray.cluster_resources().get("GPU", 0.0)

    def run(number: int, gpus: int) -> TrialResult:
        pool.submit(number, dataclasses.replace(TASK, seed=number), "sim", gpus=gpus)
        result = wait_all(pool, 1, 120.0)[number]
        assert result.status is TrialStatus.OK
        return result

    first, second = run(0, 1), run(1, 1)
    assert first.evidence[0] == second.evidence[0]  # the same process ran both
    wide = run(2, 2)  # needs both GPUs: the idle one-GPU actor must give its GPU back
    assert wide.evidence[0] != first.evidence[0] and len(wide.gpu_ids) == 2
    pool.close()
    assert _available_gpus(total) == total


def test_on_a_ray_without_gpus_sim_trials_ask_for_none_and_a_real_trial_stops_the_study_in_one_line(
        local_ray: None, tmp_path) -> None:
    """A Ray with CPUs and no GPU (a laptop, a CI runner, a CPU head node): simulated trials run
    without asking Ray for a GPU (the spec's count still bounds them); a real trial Ray cannot
    place shows as waiting, then stops the study naming what the cluster has; the finished
    trials stay, the waiting ones are told FAIL."""
    import io
    from pathlib import Path

    import optuna

    import servetune
    from servetune.errors import SpecError
    from servetune.spec.schema import StudySpec
    from servetune.study import run_study

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_gpus=0, num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(servetune.__file__).resolve().parents[1])}})
    pool = TrialPool.start(num_gpus=2)
    assert (pool.offered_gpus, pool.total_gpus) == (0, 2)
    assert pool.gpu_free("sim") and not pool.gpu_free("vllm")
    pool.submit(0, TASK, "sim", gpus=1)
    pool.submit(1, TASK, "sim", gpus=1)
    done = wait_all(pool, 2, 120.0)
    assert all(r.status is TrialStatus.OK and r.gpu_ids == [] for r in done.values())

    data = {"name": "nogpu", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 2},
            "workload": {"input_len": 128, "output_len": 16, "num_requests": 8, "concurrency": 4, "seed": 1},
            "search_space": {"params": {"max_num_seqs": [8, 16, 32, 64]}},
            "budget": {"trials": 2, "parallel": 2, "wait_for_gpus_s": 10}, "backend": "sim", "seed": 1,
            "prescreen": False, "baseline_trial": False, "warm_start": False, "multi_fidelity": False,
            "output": {"runs_dir": str(tmp_path / "runs")}}
    spec = StudySpec.from_dict(data, tmp_path, cwd=tmp_path)
    first = run_study(spec, out=io.StringIO())
    assert first.ok == 2
    out = io.StringIO()
    with pytest.raises(SpecError) as err:
        run_study(spec.with_overrides(backend="vllm", trials=4), resume=True, out=out)
    assert err.value.field == "gpu.type"
    message = str(err.value)
    assert "no live Ray node took it" in message and "0 GPUs, accelerator types: none" in message, message
    assert "budget.wait_for_gpus_s: 10 s" in message and "accelerator_type:H200" in message
    text = out.getvalue()
    assert "waiting for GPUs 2" in text and "waits for 1 H200 GPU(s)" in text, text
    trials = optuna.load_study(study_name="nogpu", storage=spec.storage.optuna_url).get_trials()
    states = sorted(t.state.name for t in trials)
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "FAIL"], states
    assert ray.available_resources().get("CPU") is not None  # Ray still answers: nothing left hanging
    ray.shutdown()
