#!/bin/bash
# Host-side steps of a model-class run (a `servetune tune` or a collection) on a lent GPU host, three
# commands back to back, each sent from the repository root with what it carries:
#   1. bash benchmarks/real_vllm/classes_host.sh keep1 NAME=MODEL...   carry .carry/part1
#      keeps payload chunk 1, writes the folder NAME under the host's home (HOST_HOME, default the host's
#      /root) with MODEL's config.json (a shipped model name, or a folder of the tree holding one) and a
#      covering tokenizer, and the host's facts.
#   2. bash benchmarks/real_vllm/classes_host.sh keep2            carry .carry/part2
#   3. bash benchmarks/real_vllm/classes_host.sh run COMMAND...   carry .carry/part3 (and .gpuwheels for a study)
#      joins and unpacks the payload once (classes_payload.sh), sets the environment a GPU host needs
#      (shared NVLink multicast off, offline, no usage stats), then runs COMMAND, e.g.
#      env SPEC=benchmarks/real_vllm/h100_l8b_fp8_tune.yaml STUDY_TIMEOUT_S=420 bash benchmarks/real_vllm/run_study_on_gpu.sh
# The host keeps its home and /tmp only while it is held (30 s after a command): send the next command at once.
set -u
OUT=${OUT:-/tmp/servetune-out}; mkdir -p "$OUT"
H=${HOST_HOME:-/root}
step=${1:-}; shift || true
case "$step" in
  keep1)
    # Every NAME=MODEL is checked before anything is copied: a wrong one costs no device time.
    for pair in "$@"; do
      model=${pair#*=}
      case "$pair" in ?*=?*) ;; *) echo "keep1: '$pair' is not NAME=MODEL (e.g. g2=gemma-2-27b)"; exit 2 ;; esac
      [ -f "$model/config.json" ] || [ -f "platform/servetune/data/models/$model/config.json" ] \
        || { echo "keep1: no config.json for '$model': name a shipped model (platform/servetune/data/models) or a folder of the tree holding one"; exit 2; }
    done
    mkdir -p "$H/stash" && cp .carry/part1/* "$H/stash/" || exit 3
    { date -u +%FT%TZ; nproc; grep MemTotal /proc/meminfo; nvidia-smi
      nvidia-smi --query-gpu=name,pci.bus_id,memory.total,driver_version,power.limit,clocks.max.sm,clocks.max.memory,compute_cap --format=csv
      python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_properties(0))"
      df -h "$H"; } > "$OUT/host_gpu.txt" 2>&1
    for pair in "$@"; do
      name=${pair%%=*}; model=${pair#*=}
      src=$model/config.json; [ -f "$src" ] || src=platform/servetune/data/models/$model/config.json
      mkdir -p "$H/$name" && cp "$src" "$H/$name/config.json" \
        && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 python3 benchmarks/real_vllm/full_vocab_tokenizer.py "$H/$name" >> "$OUT/tokenizers.txt" 2>&1 \
        || { echo "tokenizer for $model failed" >> "$OUT/tokenizers.txt"; failed=1; }
    done
    cat "$OUT/tokenizers.txt" 2>/dev/null; ls -la "$H/stash"; [ -z "${failed:-}" ] || exit 3 ;;
  keep2)
    [ -f "$H/stash/payload.tar.xz.00" ] || { echo "chunk 1 is not on this machine (was it given back?)"; exit 3; }
    cp .carry/part2/* "$H/stash/" && ls -la "$H/stash" ;;
  run)
    if [ ! -d /tmp/site/vllm ]; then
      [ -f "$H/stash/payload.tar.xz.01" ] || { echo "chunks 1-2 are not on this machine (was it given back?)"; exit 3; }
      cp .carry/part3/* "$H/stash/" && cat "$H"/stash/payload.tar.xz.* | tar -C /tmp -xJf - || { echo "unpack failed"; exit 3; }
      mkdir -p /tmp/site/bin && printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > /tmp/site/bin/vllm \
        && chmod +x /tmp/site/bin/vllm
    fi
    export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
      HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 \
      VLLM_USE_FLASHINFER_SAMPLER=0 \
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
    exec "$@" ;;
  *) echo "usage: classes_host.sh keep1 NAME=MODEL... | keep2 | run COMMAND..."; exit 2 ;;
esac
