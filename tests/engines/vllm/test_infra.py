"""Infrastructure failures: recorded as the machine's fault, re-run on another slot, never learnt.

Real parts only: the `vllm serve` stand-in as a subprocess, a real local Ray with two logical GPUs,
real Optuna. The faults are made as they happen on a host:

- GPU memory held by another process: a holder's entry in the simulated device memory
  (:mod:`servetune.sim.devices`) that both the stand-in (it is not free at startup, so vLLM's own
  "Free memory on device ... is less than desired GPU memory utilization" follows) and the
  ``nvidia-smi`` stand-in on ``PATH`` (the launcher's pre-launch reading) see;
- a port taken between the launcher's pick and the server's bind: a wrapper around the stand-in
  starts a process that listens on the chosen port first (once), so the stand-in fails with
  ``OSError: [Errno 98] Address already in use``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import ray
import yaml
from _ray_helpers import wait_all
from mlflow.tracking import MlflowClient
from ray import cloudpickle

from servetune.records import dataset
from servetune.cluster.pool import TrialPool
from servetune.engines import TrialTask
from servetune.engines.vllm.infra import (actor_death_unsettled, classify_actor_error, confirm_launch_failure,
                                         node_death_window_s)
from servetune.result import TrialResult, TrialStatus
from servetune.search.propose import tell
from servetune.sim.devices import hold
from servetune.spec.schema import StudySpec
from servetune.engines.vllm.engine import VllmLaunch, run_vllm_trial
from servetune.workload import Workload

PLATFORM = str(Path(__file__).resolve().parents[3] / "platform")
STANDIN = (sys.executable, "-m", "servetune.sim.server")
ENV = {"PYTHONPATH": PLATFORM, "SERVETUNE_SIM_STARTUP_S": "0.2", "SERVETUNE_SIM_DEATH_LINGER_S": "0.2"}
WORKLOAD = Workload.from_dict({"input_len": 128, "output_len": 16, "num_requests": 8, "concurrency": 4,
                               "warmup_requests": 1})
H200_GIB = 139.8

# The port thief: reads --port from the stand-in's argv, and the first time (a marker file) starts a
# process in its own session that listens on that port, then becomes the stand-in.
THIEF = r"""
import os, subprocess, sys
argv = sys.argv[1:]
port = argv[argv.index("--port") + 1]
marker = os.environ["THIEF_MARKER"]
if not os.path.exists(marker):
    holder = subprocess.Popen([sys.executable, "-c",
        "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); "
        "print('bound', flush=True); time.sleep(120)", port], stdout=subprocess.PIPE, start_new_session=True)
    holder.stdout.readline()
    with open(marker, "w") as f:
        f.write(f"{holder.pid} {port}")
os.execv(sys.executable, [sys.executable, "-m", "servetune.sim.server", *argv])
"""


def _nvidia_smi_shim(bin_dir: Path, ledger: Path) -> Path:
    """``nvidia-smi`` on PATH answering from the simulated device memory of this host."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexport SERVETUNE_SIM_GPU_MEMORY_DIR='{ledger}' SERVETUNE_SIM_GPU_COUNT=2 "
                   f"PYTHONPATH='{PLATFORM}'\nexec {sys.executable} -m servetune.sim.devices \"$@\"\n")
    smi.chmod(0o755)
    return bin_dir


@dataclasses.dataclass(frozen=True)
class _Host:
    """What one machine of the test looks like to a trial: its nvidia-smi, its GPU memory, the thief."""

    bin_dir: str
    ledger: str
    thief_marker: str

    def env(self) -> dict[str, str]:
        return {**ENV, "PATH": f"{self.bin_dir}{os.pathsep}{os.environ['PATH']}",
                "SERVETUNE_SIM_GPU_MEMORY_DIR": self.ledger, "SERVETUNE_SIM_GPU_COUNT": "2",
                "THIEF_MARKER": self.thief_marker}


def _kill_thief(marker: Path) -> None:
    if marker.exists():
        pid = int(marker.read_text().split()[0])
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def host(tmp_path: Path) -> Iterator[_Host]:
    ledger = tmp_path / "gpu-memory"
    h = _Host(str(_nvidia_smi_shim(tmp_path / "bin", ledger)), str(ledger), str(tmp_path / "thief"))
    yield h
    _kill_thief(Path(h.thief_marker))


def _launch(host: _Host, log_dir: Path, flags: dict, gpu: str | None, thief: bool = False) -> VllmLaunch:
    command = (sys.executable, "-c", THIEF) if thief else STANDIN
    return VllmLaunch(model="servetune-test-850m", flags=flags, serve_command=command,
                      extra_args=("--sim-gpu", "H200", "--sim-speedup", "20"), env=host.env(),
                      gpu_ids=None if gpu is None else (gpu,), startup_timeout_s=60.0, stop_grace_s=3.0,
                      log_dir=log_dir, sample_interval_s=0.05, gpu_free_timeout_s=1.0)


def _run(host: _Host, launch: VllmLaunch) -> TrialResult:
    # The launcher reads nvidia-smi from its own PATH, as it would on the host.
    old = os.environ["PATH"]
    os.environ["PATH"] = host.env()["PATH"]
    try:
        return run_vllm_trial(launch, WORKLOAD)
    finally:
        os.environ["PATH"] = old


# -- the verdict ----------------------------------------------------------------------------------

def test_memory_held_by_another_process_is_an_infra_error_with_the_reading_as_evidence(
        host: _Host, tmp_path: Path) -> None:
    hold(host.ledger, "0", 100 * 1024, holder="someone-else")
    held = _run(host, _launch(host, tmp_path / "a", {"gpu_memory_utilization": 0.9, "max_num_seqs": 8}, "0"))
    assert held.status is TrialStatus.INFRA_ERROR and held.infrastructure == "gpu_memory_held", held.cause
    assert "less than desired GPU memory utilization" in (held.cause or "")
    assert any("GPU 0: 102400 MiB" in e for e in held.evidence), held.evidence
    # The same flags on the other GPU, which nobody else uses, start and serve.
    free = _run(host, _launch(host, tmp_path / "b", {"gpu_memory_utilization": 0.9, "max_num_seqs": 8}, "1"))
    assert free.status is TrialStatus.OK and free.infrastructure is None


def test_a_budget_no_empty_gpu_has_stays_the_flags_own_startup_oom(host: _Host, tmp_path: Path) -> None:
    # The same vLLM text, but the GPU was empty before launch: the utilization is the fault.
    r = _run(host, _launch(host, tmp_path, {"gpu_memory_utilization": 0.999, "max_num_seqs": 8}, "1"))
    assert r.status is TrialStatus.STARTUP_OOM and r.infrastructure is None, (r.status, r.cause)
    assert "Free memory on device" in (r.cause or "") and not (r.cause or "").startswith("infrastructure")
    assert any("not an infrastructure failure" in e for e in r.evidence), r.evidence


def test_confirmation_without_a_reading_uses_the_log_figures() -> None:
    cause = "infrastructure failure: another process holds GPU memory: Free memory on device ..."
    v = confirm_launch_failure(cause, before_mib={}, free_gib=39.3, total_gib=H200_GIB, requested_gib=125.8)
    assert v.kind == "gpu_memory_held"
    v = confirm_launch_failure(cause, before_mib={}, free_gib=139.3, total_gib=H200_GIB, requested_gib=139.7)
    assert v.kind is None and v.status is TrialStatus.STARTUP_OOM


def test_a_port_taken_between_pick_and_bind_is_an_infra_error(host: _Host, tmp_path: Path) -> None:
    r = _run(host, _launch(host, tmp_path, {"max_num_seqs": 8}, "1", thief=True))
    assert r.status is TrialStatus.INFRA_ERROR and r.infrastructure == "port_in_use", (r.status, r.cause)
    assert "Address already in use" in (r.cause or "")
    stolen = Path(host.thief_marker).read_text().split()[1]
    assert any(f"'--port', '{stolen}'" in e for e in r.evidence)


def test_an_exhausted_infra_error_is_told_fail_never_infeasible(tmp_path: Path) -> None:
    spec = StudySpec.from_dict({
        "name": "infra-tell", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 1},
        "workload": {"input_len": 128, "output_len": 16, "num_requests": 8, "concurrency": 4},
        "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [8, 16]}}},
        "budget": {"trials": 2, "parallel": 1}, "backend": "sim",
        "tracking": {"mlflow_uri": str(tmp_path / "mlruns")},
        "storage": {"optuna_url": f"sqlite:///{tmp_path}/optuna.db"},
        "output": {"runs_dir": str(tmp_path), "dataset_dir": str(tmp_path / "dataset")},
    })
    study = optuna.create_study(directions=["maximize"])
    trial = study.ask()
    result = TrialResult(TrialStatus.INFRA_ERROR, cause="infrastructure failure: port in use: ...",
                         infrastructure="port_in_use", infra_attempts=["attempt 1 ...", "attempt 2 ...", "attempt 3 ..."])
    tell(spec, study, trial, result)
    frozen = study.trials[0]
    assert frozen.state is optuna.trial.TrialState.FAIL
    assert not frozen.constraints  # nothing the sampler could read as infeasible
    assert frozen.user_attrs["status"] == "infra_error" and len(frozen.user_attrs["infra_attempts"]) == 3


# -- the re-run on another slot ---------------------------------------------------------------------

def _standin_runner(host: _Host, task: TrialTask, backend: str) -> TrialResult:
    """The trial as the actor runs it on this host: the stand-in server on Ray's GPU, port thief armed."""
    os.environ.update(host.env())
    launch = _launch(host, Path(host.ledger).parent / "trials" / f"{task.seed}-{time.monotonic_ns()}",
                     dict(task.flags), None, thief=True)
    return run_vllm_trial(launch, task.workload)


def _task(seed: int) -> TrialTask:
    return TrialTask(model="servetune-test-850m", gpu="H200", seed=seed, workload=WORKLOAD,
                     flags={"gpu_memory_utilization": 0.9, "max_num_seqs": 8})



def test_the_pool_reruns_infra_failures_elsewhere_and_quarantines_a_slot_that_keeps_failing(host: _Host) -> None:
    if ray.is_initialized():  # another test's cluster may have a different GPU count
        ray.shutdown()
    # The workers cannot import this test module: ship its functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = TrialPool.start(num_gpus=2, num_cpus=2, runner=functools.partial(_standin_runner, host))
    try:
        # 1. The first launch finds its port taken: re-run (a new port), measured.
        pool.submit(0, _task(0), "vllm", gpus=1)
        first = wait_all(pool, 1, 180.0)[0]
        assert first.status is TrialStatus.OK, (first.cause, first.infra_attempts)
        assert len(first.infra_attempts) == 1 and "port_in_use" in first.infra_attempts[0]
        stolen = Path(host.thief_marker).read_text().split()[1]
        assert not any(f"'--port', '{stolen}'" in e for e in first.evidence if e.startswith("argv="))
        assert pool.quarantined == [] and pool.total_gpus == 2  # a taken port is not the slot's fault

        # 2. Another process now holds most of GPU 0. Two rounds of two trials: each round one lands
        # on GPU 0, fails there for the machine's reason and re-runs on GPU 1; the second failure
        # takes GPU 0 out of service.
        hold(host.ledger, "0", 100 * 1024, holder="someone-else")
        results: dict[int, TrialResult] = {}
        for round_ in ((1, 2), (3, 4)):
            for n in round_:
                pool.submit(n, _task(n), "vllm", gpus=1)
            results.update(wait_all(pool, 2, 180.0))
        assert all(r.status is TrialStatus.OK for r in results.values()), \
            {n: (r.status, r.cause) for n, r in results.items()}
        retried = {n: r for n, r in results.items() if r.infra_attempts}
        assert len(retried) == 2, {n: r.gpu_ids for n, r in results.items()}
        for r in retried.values():
            assert r.gpu_ids == ["1"]
            assert all("gpu_memory_held" in a and "GPU(s) 0" in a for a in r.infra_attempts), r.infra_attempts
        assert pool.quarantined == ["0"] and pool.total_gpus == 1, pool.quarantine_notes
        assert "after 2 infrastructure failures (gpu_memory_held)" in pool.quarantine_notes[0]
        # Later trials never land on the quarantined slot.
        pool.submit(5, _task(5), "vllm", gpus=1)
        last = wait_all(pool, 1, 180.0)[5]
        assert last.status is TrialStatus.OK and last.gpu_ids == ["1"] and not last.infra_attempts
    finally:
        TrialPool.shutdown()


# -- the driver -----------------------------------------------------------------------------------

def _study(tmp: Path, name: str, trials: int, parallel: int) -> Path:
    spec = {
        "name": name, "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 2},
        "workload": {"input_len": 128, "output_len": 16, "num_requests": 8, "concurrency": 4, "seed": 1},
        "search_space": {"params": {"max_num_seqs": [8, 16, 32, 64]}},
        "fixed_flags": {"gpu_memory_utilization": 0.9},
        "budget": {"trials": trials, "parallel": parallel}, "backend": "vllm", "seed": 5,
        # Only the infrastructure path is under test: no simulator screen, baseline or warm start
        # (each would add trials told without a launch).
        "multi_fidelity": False, "baseline_trial": False, "warm_start": False,
        "tracking": {"mlflow_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": name},
        "storage": {"optuna_url": f"sqlite:///{tmp}/optuna.db"},
        "output": {"runs_dir": str(tmp / "runs"), "dataset_dir": str(tmp / "dataset")},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _tune(host: _Host, spec: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**host.env(), "HOME": str(tmp), "RAY_AUTH_MODE": "disabled", "MLFLOW_DISABLE_TELEMETRY": "true",
           "SERVETUNE_SERVE_COMMAND": f"{sys.executable} -m servetune.sim.server --sim-speedup 20"}
    return subprocess.run([sys.executable, "-m", "servetune", "tune", str(spec)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp)


@pytest.mark.slow
def test_the_driver_reruns_an_infra_failure_and_tells_an_exhausted_one_fail(host: _Host, tmp_path: Path) -> None:
    # 1. Another process holds most of GPU 0: trials that land there run again on GPU 1.
    hold(host.ledger, "0", 100 * 1024, holder="someone-else")
    proc = _tune(host, _study(tmp_path, "infra-one", trials=4, parallel=2), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "infrastructure failure, re-run elsewhere" in proc.stdout and "gpu_memory_held" in proc.stdout
    study = optuna.load_study(study_name="infra-one", storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 4 and {t.state for t in trials} == {optuna.trial.TrialState.COMPLETE}
    assert all(t.constraints["startup"] < 0 for t in trials)  # the flags start on a free GPU: never infeasible
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = [r for r in client.search_runs([client.get_experiment_by_name("infra-one").experiment_id])
            if r.data.tags.get("servetune.role") == "trial"]
    assert len(runs) == 4 and any(r.data.tags.get("servetune.infra_attempts") for r in runs)

    # 2. Both GPUs held: every attempt fails for the machine's reason. The trial is told FAIL (never
    # infeasible), recorded and reported; both slots end quarantined and the study stops.
    hold(host.ledger, "1", 100 * 1024, holder="someone-else")
    proc = _tune(host, _study(tmp_path, "infra-all", trials=2, parallel=1), tmp_path)
    assert "infrastructure failures (told FAIL, not learnt)" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every GPU slot is quarantined" in proc.stdout
    study = optuna.load_study(study_name="infra-all", storage=f"sqlite:///{tmp_path}/optuna.db")
    failed = study.get_trials(deepcopy=False)
    assert failed and all(t.state is optuna.trial.TrialState.FAIL for t in failed)
    assert all(t.user_attrs["status"] == "infra_error" and not t.constraints for t in failed)
    assert len(failed[0].user_attrs["infra_attempts"]) == 3
    rows = dataset.read_trials(tmp_path / "dataset", study="infra-all")
    assert sorted(rows["trial_number"]) == [t.number for t in failed] and set(rows["status"]) == {"infra_error"}


# Ray's own words, as its GCS writes them (gcs_server of ray 2.60.0).
_WORKER_DIED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: TrialActor\n"
                "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR")
_NODE_DIED = "The actor died because its node has died. Node Id: 2ae86b0540b6"
_KILLED = "The actor is dead because it was killed by `ray.kill`."


@pytest.mark.parametrize("exc_type, text, alive, kind, unsettled", [
    ("ActorDiedError", _WORKER_DIED, True, None, True),       # the node may yet be marked dead: ask again
    ("ActorDiedError", _WORKER_DIED, False, "node_lost", False),
    ("ActorDiedError", _WORKER_DIED, None, None, False),      # no node to ask about: the trial's crash
    ("ActorDiedError", _NODE_DIED, True, "node_lost", False),
    ("ActorDiedError", _KILLED, True, None, False),           # killed on purpose: never a node's loss
    ("ActorUnavailableError", "RpcError: Socket closed", True, "node_lost", False),
])
def test_an_actor_death_is_told_at_once_only_where_rays_words_or_tables_settle_it(
        exc_type: str, text: str, alive: bool | None, kind: str | None, unsettled: bool) -> None:
    assert classify_actor_error(exc_type, text, alive) == kind
    assert actor_death_unsettled(exc_type, text, alive) is unsettled


def test_the_settling_window_is_rays_health_check_as_the_environment_sets_it() -> None:
    assert node_death_window_s({}) == 25.0  # ray_config_def.h: 5 checks 3 s apart, the last timing out after 10 s
    env = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "500",
           "RAY_health_check_failure_threshold": "3"}
    assert node_death_window_s(env) == 3.5
    for bad in ("", "x", "-1", "0", "inf", "nan"):  # Ray would not run with these: its default stands
        assert node_death_window_s({**env, "RAY_health_check_period_ms": bad}) == 3 * 3.0 + 0.5
