#!/bin/bash
# Host-side: run a real servetune study (Ray local, Optuna SQLite, MLflow SQLite, Parquet dataset,
# real `vllm serve`) on the H200 host, then bring the results back through $OUT.
#
# Sent from the repository root, after shared/gpu/stage1.sh, through stage2.sh (which unpacks
# vLLM into /tmp/site, puts `vllm` on PATH and sets the NVLink-safety environment):
#     carry [".carry/part2", ".carry/gpu", ".gpuwheels"]
#     bash .carry/gpu/stage2.sh bash benchmarks/real_vllm/run_study_on_gpu.sh [servetune tune args]
# The stage1 call (carry .carry/part1, 60.8 MB) no longer fits the 64 MiB transfer limit together
# with the tree (tests/fixtures is 5+ MB): move tests/fixtures out of the tree for that one call
# (it needs none of it) and back afterwards.
# e.g. no args for the first command, then `--resume` (both stop asking for new trials after the
# spec's budget.time_limit_s, 300 s). A later command on the same held host needs neither chunk
# again: carry [".carry/gpu"] is enough once /tmp/site and /tmp/studysite exist.
#
# Environment (all optional): SPEC (default benchmarks/real_vllm/h200_study.yaml),
# STUDY_TIMEOUT_S (default 500: the study gets SIGINT then, which ends it cleanly, keeping every
# finished trial, so the results still come back inside the 600 s command limit),
# SERVETUNE_STARTUP_TIMEOUT_S (default 240; measured startups are 46-113 s), RESTORE (default
# .gpuwheels/h200_study.tar.gz: the runs dir to start from when this host has none, e.g. a fresh
# host). A resumed study's sampler seed is the driver's business
# (servetune.study offsets it by the trials already told; a grid keeps its seed).
#
# $OUT gets: study.log (servetune's output), study_times.log (the same, each line with the seconds
# since `servetune tune` started), h200_study.tar.gz (the runs dir: optuna.db, mlflow.db,
# mlartifacts/, dataset/, trials/*/server.log), mlflow_runs.txt (every MLflow run with its status
# tags and key metrics, then every Optuna trial), host_env.txt (versions, GPU memory), and
# ray_logs.tar.gz when the study ended abnormally.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 3
ROOT=$PWD
OUT=${OUT:-/tmp/servetune-out}; mkdir -p "$OUT"
SPEC=${SPEC:-benchmarks/real_vllm/h200_study.yaml}
RUNS_HOME=${RUNS_HOME:-/root}
T0=$(date +%s)

# -- the study bundle: ray, optuna, mlflow-skinny and their closure (build_study_payload.sh) ------
if [ ! -d /tmp/studysite/ray ]; then
  [ -f .gpuwheels/studysite.tar.xz ] || { echo "no .gpuwheels/studysite.tar.xz: carry .gpuwheels (build it with benchmarks/real_vllm/build_study_payload.sh)"; exit 3; }
  tar -C /tmp -xJf .gpuwheels/studysite.tar.xz || { echo "unpacking studysite failed"; exit 3; }
fi
# /tmp/studysite goes AFTER the vLLM payload (/tmp/site, put first by stage2.sh): every `vllm serve`
# a trial starts inherits this PYTHONPATH, and must import vLLM's own pinned packages first. The
# bundle holds nothing the payload holds except cachetools (7.3.3, mlflow's fallback when /tmp/site
# is absent), so nothing else depends on the order.
export PYTHONPATH="$ROOT/platform${PYTHONPATH:+:$PYTHONPATH}:/tmp/studysite"
export MLFLOW_DISABLE_TELEMETRY=true MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=true \
  RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 \
  SERVETUNE_STARTUP_TIMEOUT_S=${SERVETUNE_STARTUP_TIMEOUT_S:-240}
# stage2.sh sets these; set again so that running this script any other way stays safe. Every
# process the study starts (Ray workers, vllm serve) inherits them.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0 \
  VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset VLLM_ALLREDUCE_USE_FLASHINFER VLLM_USE_NCCL_SYMM_MEM

{
  echo "date: $(date -u +%FT%TZ)  args: $*"
  python3 - <<'EOF'
import importlib.metadata as md
names = ["ray", "optuna", "mlflow-skinny", "sqlalchemy", "alembic", "vllm", "torch", "numpy", "pandas", "pyarrow",
         "protobuf", "cachetools", "pydantic", "aiohttp", "matplotlib", "pyyaml", "grpcio"]
def v(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "-"
print("packages: " + ", ".join(f"{n} {v(n)}" for n in names))
EOF
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>&1
  ls -d /root/model 2>&1
} > "$OUT/host_env.txt" 2>&1
cat "$OUT/host_env.txt"
python3 -c "import ray, optuna, mlflow, sqlalchemy, alembic, mlflow.store.tracking.sqlalchemy_store, servetune.study" \
  || { echo "the study bundle does not import: see above"; exit 4; }

# -- the runs dir lives in $RUNS_HOME (/root), outside the working tree, so a later command's fresh copy of the
#    tree cannot drop it; the tree gets a link (followed when the results are packed) -------------
RUNS=$(python3 - "$SPEC" <<'EOF'
import sys
from pathlib import Path
from servetune.spec.schema import load_spec
runs = load_spec(sys.argv[1]).output.runs_dir
try:
    print(runs.relative_to(Path.cwd()))
except ValueError:
    print(runs)  # outside the tree: nothing to link
EOF
) || { echo "the spec does not load: see above"; exit 2; }
case "$RUNS" in /*) ;; *)
  # A fresh host has no runs dir: restore it from the h200_study.tar.gz
  # an earlier command brought back, if it was copied into .gpuwheels/, so --resume still works.
  if [ ! -d "$RUNS_HOME/$RUNS" ] && [ -f "${RESTORE:-.gpuwheels/h200_study.tar.gz}" ]; then
    mkdir -p "$RUNS_HOME" && tar -C "$RUNS_HOME" -xzf "${RESTORE:-.gpuwheels/h200_study.tar.gz}" "$RUNS" \
      && echo "restored $RUNS_HOME/$RUNS from ${RESTORE:-.gpuwheels/h200_study.tar.gz}"
  fi
  if [ ! -e "$RUNS" ] || [ -L "$RUNS" ]; then mkdir -p "$RUNS_HOME/$RUNS" && ln -sfn "$RUNS_HOME/$RUNS" "$RUNS"; fi ;;
esac

# -- the study ------------------------------------------------------------------------------------
LEFT=$(( ${STUDY_TIMEOUT_S:-500} - ($(date +%s) - T0) ))
echo "servetune tune $SPEC $* (SIGINT after ${LEFT} s)"
# study_times.log: each line of the output with the seconds since `servetune tune` was started, so
# the time to the confirmed winner ("winner on confirmed figures") is read as a user would see it.
timeout -s INT -k 45 "$LEFT" python3 -m servetune tune "$SPEC" "$@" 2>&1 | python3 -u -c '
import sys, time
t0 = time.monotonic()
with open(sys.argv[1], "w") as plain, open(sys.argv[2], "w") as timed:
    for line in sys.stdin:
        for f in (sys.stdout, plain):
            f.write(line)
        timed.write(f"{time.monotonic() - t0:8.1f} {line}")
        for f in (sys.stdout, plain, timed):
            f.flush()
' "$OUT/study.log" "$OUT/study_times.log"
RC=${PIPESTATUS[0]}
echo "servetune tune exited with $RC after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/study.log"
# 124: our own SIGINT at STUDY_TIMEOUT_S, a planned stop (finished trials are kept); report it as 0,
# since the device tool reads an exit status of 124 as the command having run past its limit.
[ "$RC" = 124 ] && { echo "stopped at STUDY_TIMEOUT_S; continue with --resume" | tee -a "$OUT/study.log"; RC=0; }

# On SIGINT the driver kills its trial's Ray actor, and a `vllm serve` it started (own session)
# can outlive it and hold the GPU into the next command: stop the process group of every GPU
# process that is a vLLM server, by id (this host runs nothing else on the GPU).
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
  case "$pid" in ''|*[!0-9]*) continue ;; esac
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qi vllm || continue
  pgid=$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')
  echo "stopping leftover vLLM process $pid (group ${pgid:-?})"
  if [ -n "$pgid" ] && [ "$pgid" -gt 1 ]; then kill -TERM -- "-$pgid" 2>/dev/null; else kill -TERM "$pid" 2>/dev/null; fi
done

# -- results --------------------------------------------------------------------------------------
python3 - "$SPEC" > "$OUT/mlflow_runs.txt" 2>&1 <<'EOF'
import sys
import optuna
from mlflow import MlflowClient
from servetune.spec.schema import load_spec
from servetune.study import best_trial
spec = load_spec(sys.argv[1])
client = MlflowClient(tracking_uri=spec.tracking.mlflow_uri)
exp = client.get_experiment_by_name(spec.tracking.experiment)
print(f"MLflow {spec.tracking.mlflow_uri}, experiment {spec.tracking.experiment!r} "
      f"(id {exp.experiment_id if exp else '-'}, artifacts {exp.artifact_location if exp else '-'})")
runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"], max_results=1000) if exp else []
keys = ("output_throughput", "preemptions", "ttft_p99_ms", "itl_p99_ms", "startup_s", "duration_s", "dispatch_s",
        "overhead_s", "timing_torch_compile_s", "compile_cache_hit", "timing_stop_s", "timing_gpu_free_s",
        "kv_cache_tokens", "num_gpu_blocks", "kv_cache_usage_peak", "completed", "failed")
for r in runs:
    tags, m, p = r.data.tags, r.data.metrics, r.data.params
    flags = {k: p[k] for k in ("gpu_memory_utilization", "max_num_seqs", "max_model_len") if k in p}
    print(f"\n{r.info.run_name}  status={r.info.status}  servetune.status={tags.get('servetune.status', '-')}"
          f"  role={tags.get('servetune.role', 'trial')}  id={r.info.run_id}")
    if flags:
        print("  flags: " + ", ".join(f"{k}={v}" for k, v in flags.items()))
    shown = {k: m[k] for k in keys if k in m} or {k: v for k, v in sorted(m.items())[:12]}
    if shown:
        print("  metrics: " + ", ".join(f"{k}={v:,.4g}" for k, v in shown.items()))
    per_gpu = {k: v for k, v in sorted(m.items()) if k.startswith("worker_") or k.endswith("_used_mib_peak")}
    if per_gpu:
        print("  per GPU: " + ", ".join(f"{k}={v:,.4g}" for k, v in per_gpu.items()))
    if tags.get("servetune.cause"):
        print("  cause: " + tags["servetune.cause"][:300])
    arts = [a.path for a in client.list_artifacts(r.info.run_id)]
    print("  artifacts: " + (", ".join(arts) or "-"))
print(f"\n{len(runs)} MLflow runs")
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.load_study(study_name=spec.name, storage=spec.storage.optuna_url)
print(f"\nOptuna {spec.storage.optuna_url}, study {spec.name!r}:")
for t in study.trials:
    print(f"  #{t.number} {t.state.name} {t.params} values={t.values} status={t.user_attrs.get('status')} "
          f"constraints={t.constraints}")
best = best_trial(study)
print(f"best: #{best.number} {best.user_attrs.get('flags')} {best.values}" if best else "best: none feasible")
EOF
cat "$OUT/mlflow_runs.txt"
tar -chzf "$OUT/h200_study.tar.gz" "$RUNS" "$SPEC" 2>&1 | tail -3
# Ray's own logs, when the study did not end normally (0: done or stopped on time, 1: nothing feasible).
case "$RC" in 0|1) ;; *) [ -d /tmp/ray/session_latest/logs ] && tar -chzf "$OUT/ray_logs.tar.gz" -C /tmp/ray/session_latest logs ;; esac
ls -l "$OUT"
exit "$RC"
