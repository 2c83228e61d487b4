"""Run real ``vllm serve`` with several flag sets and keep the raw evidence (GPU host only).

For each flag set of a plan (JSON): launch ``vllm serve`` in its own process group on 127.0.0.1,
wait for ``/health``, scrape ``/metrics``, send the workload with servetune's load generator
(sampling the gauges every 0.5 s), scrape again, stop the process group and wait for the GPU
memory to come back. Everything lands in ``OUT/real/<name>/``: ``server.log``,
``metrics_before.txt``, ``metrics_after.txt``, ``gauges.json``, ``requests.json``,
``summary.json``; the folder is packed into ``OUT/real.tar.gz`` after every set, so a run cut
short still returns what it finished.

A run may instead list ``windows``: several workloads measured one after another on the same
server start (each window its own folder ``OUT/real/<name>/<window>/`` with its own ``/metrics``
before/after, gauges, requests and ``summary.json``). A vLLM start of an 8B-14B model costs 1-2
minutes of GPU time and a window 10-30 s, so one start serves every load shape of a flag set.

A window with ``profile_after_s`` is profiled by vLLM's own torch profiler (the start's flags carry
``profiler_config``, a dict passed as JSON: ``torch_profiler_dir``, ``max_iterations``,
``detailed_trace_annotation``): /start_profile that far into the window, /stop_profile at its end.
Its summary says ``"profiled": true``; the worker's raw trace lands beside the packed evidence as
``OUT/trace_<start>_<window>.json.gz`` and its engine steps (``trace_steps.py``) as the window's
``steps.json.gz``: the fixtures keep the steps, what every reader of a trace reads (the raw traces,
0.6-3.7 MB each, were reduced to them with ``trace_steps.py --window``). The profiler records its first step
seconds after /start_profile returns (2-6 s on the H100 SXM hosts of 2026-12-07, vLLM 0.26.0): a window of under
~15 s of work caught only its tail there (``real_h100_classes/2026-12-07_q35moe20tri_prof_small_u09_default``,
``p1024_o64_c16_prof``), so give a profiled window twice the requests its 40 steps need, or a steady load.

Usage on the GPU host, inside its ``stage2.sh`` (vLLM's payload first on the
path) and with the study bundle of ``build_study_payload.sh`` unpacked at ``/tmp/studysite`` (by
``run_study_on_gpu.sh``, or ``tar -C /tmp -xJf .gpuwheels/studysite.tar.xz``): servetune's packages
import optuna, which the vLLM payload lacks::

    OUT=$OUT/c bash .carry/gpu/stage2.sh bash -c \
      'PYTHONPATH=$PWD/platform:$PYTHONPATH:/tmp/studysite python3 benchmarks/real_vllm/collect.py PLAN.json'
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from pathlib import Path

from servetune.engines.vllm.loadgen import run_workload
from servetune.engines.vllm.metrics import gauge, parse_prometheus
from servetune.result import summarize
from servetune.engines.vllm.engine import gpu_memory_used_mib
from servetune.planner.flags import argv_value
from servetune.workload import Workload

MODEL = os.environ.get("SERVETUNE_REAL_MODEL", "/root/model")


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
        return 0, str(exc)


def _port_taken(base: str) -> str | None:
    """Why a server must not be launched at ``base``: something already answers there (a server left
    from an earlier run would be measured in place of the one launched, whose own start then fails
    to bind); None when nothing answers."""
    status, _ = _get(base + "/health", 2)
    if status:
        return f"{base} already answers /health (HTTP {status}): another server holds the port; stop it first"
    return None


def _argv(flags: dict, model: str = MODEL) -> list[str]:
    argv = ["vllm", "serve", argv_value(model, "model"), "--host", "127.0.0.1", "--port", "8011"]
    for key, value in flags.items():
        opt = "--" + key.replace("_", "-")
        if value is True:
            argv.append(opt)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):  # a config group (--profiler-config, --compilation-config)
            argv += [opt, json.dumps(value)]
        else:
            argv += [opt, str(value)]
    return argv


def run_one(name: str, flags: dict, workload_dict: dict, out: Path, deadline: float, bench: bool,
            repeats: int = 1) -> dict:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    argv = _argv(flags)
    summary: dict = {"name": name, "flags": flags, "workload": workload_dict, "argv": argv}
    base = "http://127.0.0.1:8011"
    if (taken := _port_taken(base)) is not None:
        summary.update(healthy=False, error=taken)
        (d / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        return summary
    log = open(d / "server.log", "w")
    t_launch = time.time()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        healthy = _wait_healthy(proc, base, min(deadline, t_launch + 300))
        summary["startup_s"] = time.time() - t_launch
        summary["healthy"] = healthy
        summary["exit_code"] = proc.poll()
        if not healthy:
            return summary
        # repeats > 1 alternates servetune's load generator and `vllm bench serve` on one server,
        # so neither gets the warmer server: the agreement check of the two clients.
        for rep in range(int(repeats)):
            sfx = "" if rep == 0 else f"_{rep}"
            figures = _window(base, MODEL, workload_dict, d, suffix=sfx)
            if rep == 0:
                summary.update(figures)
            summary.setdefault("ours", []).append(figures)
            if bench:
                wl = workload_dict
                bench_argv = ["vllm", "bench", "serve", "--backend", "openai", "--base-url", base, "--model", MODEL,
                              "--dataset-name", "random", "--random-input-len", str(wl["input_len"]),
                              "--random-output-len", str(wl["output_len"]), "--num-prompts", str(wl["num_requests"]),
                              "--max-concurrency", str(wl["concurrency"]), "--ignore-eos", "--save-result",
                              "--result-dir", str(d), "--result-filename", f"bench{sfx}.json", "--seed", str(rep),
                              "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
                with open(d / f"bench{sfx}.log", "w") as blog:
                    subprocess.run(bench_argv, stdout=blog, stderr=subprocess.STDOUT,
                                   timeout=max(10, deadline - time.time()))
    except Exception as exc:  # noqa: BLE001 - keep what we have
        summary["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        summary["stop_s"], summary["gpu_used_mib_after_stop"] = _stop_server(proc)
        log.close()
        (d / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _wait_healthy(proc: subprocess.Popen, base: str, until: float) -> bool:
    """Poll ``/health`` once a second until it answers 200 (True), the server exits or ``until`` passes."""
    while time.time() < until:
        if proc.poll() is not None:
            return False
        if _get(base + "/health", 2)[0] == 200:
            return True
        time.sleep(1)
    return False


def _stop_server(proc: subprocess.Popen) -> tuple[float, list[int]]:
    """SIGTERM the server's process group (SIGKILL after 20 s); wait for the GPU memory to return."""
    t_stop = time.time()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for _ in range(30):
        used = list(gpu_memory_used_mib(None).values())
        if not used or max(used) < 1024:
            break
        time.sleep(0.5)
    return time.time() - t_stop, list(gpu_memory_used_mib(None).values())


def _tokenizer_vocab(model: str) -> int | None:
    """Tokens in the model folder's tokenizer (with its added tokens), or None when unreadable.

    A random-weight model whose tokenizer is smaller than its vocabulary samples ids with no text,
    which sends vLLM's API server down a path no real checkpoint takes (scale/tokenizers.json).
    """
    try:
        tok = json.loads((Path(model) / "tokenizer.json").read_text())
        return len(tok["model"]["vocab"]) + len(tok.get("added_tokens") or [])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _post(url: str, timeout: float = 180.0) -> int:
    try:
        req = urllib.request.Request(url, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except Exception:  # noqa: BLE001 - the window goes on; the missing trace says it failed
        return 0


def _window(base: str, model: str, workload_dict: dict, d: Path, suffix: str = "",
            profile_after_s: float | None = None) -> dict:
    """One measured window on a running server: /metrics before and after, gauges, requests.

    ``suffix`` names a repeat's files (``metrics_after_1.txt``, ...) beside the first window's;
    ``metrics_before.txt`` is written by the first only (a repeat starts where the last ended).
    ``profile_after_s``: POST /start_profile that long into the window (the server's
    ``--profiler-config`` says how many steps) and /stop_profile at its end. Exporting the trace
    stalls the engine, so a profiled window's figures are not a clean window's.
    """
    d.mkdir(parents=True, exist_ok=True)
    if not suffix:
        (d / "metrics_before.txt").write_text(_get(base + "/metrics")[1])
    samples: list[dict] = []

    async def sample() -> None:
        loop = asyncio.get_running_loop()
        status, text = await loop.run_in_executor(None, _get, base + "/metrics", 2.0)
        if status == 200:
            m = parse_prometheus(text)
            samples.append({"t": time.time(), "kv": gauge(m, "vllm:kv_cache_usage_perc"),
                            "running": gauge(m, "vllm:num_requests_running"),
                            "waiting": gauge(m, "vllm:num_requests_waiting")})

    t0, cpu0 = time.time(), time.process_time()
    timer = None
    if profile_after_s is not None:
        timer = threading.Timer(profile_after_s, _post, [base + "/start_profile"])
        timer.start()
    try:
        records, duration = asyncio.run(run_workload(base, model, Workload.from_dict(workload_dict), on_tick=sample))
    finally:
        if timer is not None:
            timer.cancel()
            _post(base + "/stop_profile")
    # The load generator's own CPU (this process, every thread: the SSE reader and the gauge
    # sampler): a client that reads one chunk at a time can bound a window (the 0.85B windows at
    # 256 in flight), and the simulator's client stage needs a measured cost per chunk.
    client_cpu_s = time.process_time() - cpu0
    (d / f"metrics_after{suffix}.txt").write_text(_get(base + "/metrics")[1])
    (d / f"gauges{suffix}.json").write_text(json.dumps(samples))
    (d / f"requests{suffix}.json").write_text(json.dumps([dataclasses.asdict(r) for r in records]))
    s = summarize(records, duration)
    figures = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in s.items()}
    figures["window_wall_s"] = time.time() - t0
    figures["client_cpu_s"] = client_cpu_s
    figures["client_busy"] = client_cpu_s / duration if duration > 0 else None
    return figures


def _keep_trace(flags: dict, since: float, d: Path, raw_dest: Path, max_raw: int = 15 << 20) -> dict:
    """The worker trace a profiled window left in the profiler's folder: ``steps.json.gz`` (its engine
    steps, ``trace_steps.steps_from_trace``) in the window's folder, the raw trace beside the
    packed evidence when it fits the host's 16 MiB a file."""
    folder = Path(str((flags.get("profiler_config") or {}).get("torch_profiler_dir", "")))
    found: list[Path] = []
    for _ in range(60):  # the export runs inside the engine after the last profiled step
        found = sorted((p for p in folder.glob("*.pt.trace.json*") if p.stat().st_mtime >= since),
                       key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
        if found and time.time() - found[-1].stat().st_mtime > 3:
            break
        time.sleep(1)
    if not found:
        return {"error": f"no trace in {folder}"}
    trace = found[-1]
    info: dict = {"file": trace.name, "bytes": trace.stat().st_size}
    if trace.stat().st_size <= max_raw:
        shutil.copyfile(trace, raw_dest)
        info["raw"] = raw_dest.name
    try:
        from trace_steps import STEPS, load_trace, steps_from_trace, write_steps
        steps = steps_from_trace(load_trace(trace))
        write_steps(steps, d / STEPS)
        info["steps"] = len(steps["steps"])
    except Exception as exc:  # noqa: BLE001 - the raw trace is the evidence; the summary is a convenience
        info["steps_error"] = f"{type(exc).__name__}: {exc}"
    return info


def run_windows(item: dict, out: Path, deadline: float, pack) -> dict:
    """One server start, then each of ``item["windows"]`` in turn (skipped past the deadline)."""
    name, flags = item["name"], item["flags"]
    model = item.get("model", MODEL)
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    argv = _argv(flags, model)
    summary: dict = {"name": name, "flags": flags, "model": model, "argv": argv,
                     "tokenizer_vocab": _tokenizer_vocab(model), "windows": {}}
    base = "http://127.0.0.1:8011"
    if (taken := _port_taken(base)) is not None:
        summary.update(healthy=False, error=taken)
        (d / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        return summary
    t_launch = time.time()
    with open(d / "server.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            healthy = _wait_healthy(proc, base, min(deadline, t_launch + 300))
            summary.update(startup_s=time.time() - t_launch, healthy=healthy, exit_code=proc.poll())
            for k, win in enumerate(item["windows"] if healthy else ()):
                # Prompt token ids follow (seed, request index): windows of one start that shared a
                # seed re-sent earlier prompts, which vLLM's prefix cache then served (the 2026-12-01
                # scale runs, up to 98% of prompt tokens). Each window after the first gets its own
                # seed unless the plan pins it with "same_prompts": true.
                if k and not win.get("same_prompts"):
                    win = {**win, "workload": {**win["workload"], "seed": int(win["workload"].get("seed", 0)) + 1000 * k}}
                est = float(win.get("est_s", 30))
                if time.time() + est > deadline:
                    summary["windows"][win["name"]] = {"skipped": "deadline"}
                    continue
                wsum = {"server": name, "flags": flags, "model": model, "workload": win["workload"]}
                profile_after_s = win.get("profile_after_s")
                if profile_after_s is not None:
                    wsum["profiled"] = True
                t_window = time.time()
                try:
                    wsum.update(_window(base, model, win["workload"], d / win["name"], profile_after_s=profile_after_s))
                except Exception as exc:  # noqa: BLE001 - keep the other windows
                    wsum["error"] = f"{type(exc).__name__}: {exc}"
                if profile_after_s is not None:
                    wsum["trace"] = _keep_trace(flags, t_window, d / win["name"], out.parent / f"trace_{name}_{win['name']}.json.gz")
                (d / win["name"] / "summary.json").write_text(json.dumps(wsum, indent=1, default=str))
                summary["windows"][win["name"]] = {k: wsum.get(k) for k in
                                                   ("output_throughput", "completed", "window_wall_s", "error", "trace")}
                print(json.dumps({"run": name, "window": win["name"], **summary["windows"][win["name"]]},
                                 default=str), flush=True)
                pack()
        except Exception as exc:  # noqa: BLE001 - keep what we have
            summary["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            summary["stop_s"], summary["gpu_used_mib_after_stop"] = _stop_server(proc)
    (d / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    out = Path(os.environ.get("OUT", "/tmp/out")) / "real"
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + float(plan.get("budget_s", 540))

    def pack() -> None:
        with tarfile.open(out.parent / "real.tar.gz", "w:gz") as tar:
            tar.add(out, arcname="real")

    for item in plan["runs"]:
        if time.time() > deadline - float(item.get("min_s", 60)):
            print("skipping", item["name"], "(budget)", flush=True)
            continue
        if "windows" in item:
            s = run_windows(item, out, deadline, pack)
        else:
            s = run_one(item["name"], item["flags"], item["workload"], out, deadline, item.get("bench", False),
                        item.get("repeats", 1))
        print(json.dumps({k: s.get(k) for k in ("name", "healthy", "startup_s", "output_throughput", "completed")},
                         default=str), flush=True)
        pack()


if __name__ == "__main__":
    main()
