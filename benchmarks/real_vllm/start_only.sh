#!/bin/bash
# One `vllm serve` start, no load (GPU host only, inside shared/gpu's stage2 environment):
#     RES=DIR MODEL=/root/go20 MML=8192 bash benchmarks/real_vllm/start_only.sh NAME UTIL LIMIT_S [more vllm args]
# Starts vLLM (random weights, no prefix caching unless PC=1, vLLM's default batch sizes, DEBUG log level) in its
# own process group on 127.0.0.1 with the allocator probe of alloc_probe/ on PYTHONPATH, waits for
# /health, the process to exit, or LIMIT_S; stops the group and waits for the GPU's memory to return.
# Writes RES/NAME/{server.log,summary.json,gpu_used_at_end.txt} (RES: a folder on the GPU host); exit 0 if it served.
# BENCH="vllm bench serve args...": once healthy, run that load against it first (its output in RES/NAME/bench.txt,
# the server's /metrics before and after in metrics_{before,after}.txt); --base-url and --model are added.
# The probe was sent beside this script as .carry/go/probe: point PROBE at its folder.
set -u
name=$1; u=$2; limit=$3; shift 3
d=${RES:?RES: the results folder on the GPU host}/$name; mkdir -p $d
MODEL=${MODEL:?MODEL: the model folder}; MML=${MML:-8192}
pc=--no-enable-prefix-caching; [ "${PC:-0}" = 1 ] && pc=--enable-prefix-caching
argv=(vllm serve $MODEL --host 127.0.0.1 --port 8011 --max-model-len $MML --gpu-memory-utilization $u $pc --load-format dummy "$@")
t0=$(date +%s.%N)
ST_PROBE=1 PYTHONPATH=${PROBE:-$PWD/benchmarks/real_vllm/alloc_probe}:$PYTHONPATH VLLM_LOGGING_LEVEL=DEBUG setsid "${argv[@]}" > $d/server.log 2>&1 < /dev/null &
pid=$!
status=timeout
while true; do
  if curl -sf -m 2 http://127.0.0.1:8011/health >/dev/null 2>&1; then status=healthy; break; fi
  if ! kill -0 $pid 2>/dev/null; then status=exited; break; fi
  python3 -c "import sys,time; sys.exit(0 if time.time()-$t0 < $limit else 1)" || break
  sleep 1
done
t1=$(date +%s.%N)
if [ $status = healthy ] && [ -n "${BENCH:-}" ]; then
  curl -s -m 10 http://127.0.0.1:8011/metrics > $d/metrics_before.txt
  timeout 300 vllm bench serve --base-url http://127.0.0.1:8011 --model $MODEL $BENCH > $d/bench.txt 2>&1
  curl -s -m 10 http://127.0.0.1:8011/metrics > $d/metrics_after.txt
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits > $d/gpu_used_at_end.txt 2>&1
rc=""; if [ $status = exited ]; then wait $pid; rc=$?; fi
kill -TERM -- -$pid 2>/dev/null
for i in $(seq 1 30); do kill -0 -- -$pid 2>/dev/null || break; sleep 0.5; done
kill -KILL -- -$pid 2>/dev/null
t2=$(date +%s.%N)
for i in $(seq 1 40); do m=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1); [ "$m" -lt 1000 ] && break; sleep 0.5; done
python3 - "$d" "$name" "$u" "$status" "$t0" "$t1" "$t2" "${rc:-null}" "$MODEL" "$MML" "${argv[@]}" <<'PY'
import json, subprocess, sys
d, name, u, status, t0, t1, t2, rc, model, mml = sys.argv[1:11]; argv = sys.argv[11:]
used = [int(x) for x in subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.split()]
s = {"name": name, "flags": {"max_model_len": int(mml), "gpu_memory_utilization": float(u), "enable_prefix_caching": "--enable-prefix-caching" in argv, "load_format": "dummy"},
     "model": model, "argv": argv, "windows": {},
     "startup_s": float(t1) - float(t0), "healthy": status == "healthy", "outcome": status,
     "exit_code": None if rc == "null" else int(rc), "stop_s": float(t2) - float(t1), "gpu_used_mib_after_stop": used}
extra = argv[argv.index("dummy") + 1:]  # the "more vllm args" of the command line: --flag VALUE, or a --switch
i = 0
while i < len(extra):
    name = extra[i].lstrip("-").replace("-", "_")
    if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
        value = extra[i + 1]
        s["flags"][name] = int(value) if value.isdigit() else value
        i += 2
    else:
        s["flags"][name] = True
        i += 1
json.dump(s, open(f"{d}/summary.json", "w"), indent=1)
print(json.dumps({k: s[k] for k in ("name", "healthy", "outcome", "startup_s", "exit_code")}))
PY
grep -E "Model loading took|Available KV cache|GPU KV cache size|Maximum concurrency|CUDAGraph memory|Actual usage|OutOfMemory|warming up sampler|Graph capturing finished|init engine|ST_PROBE" $d/server.log | cut -c1-400 | tail -12
[ $status = healthy ]
