#!/bin/bash
# CPU-side (no GPU needed): build the vLLM 0.26.0 payload for the model-class runs on a GPU host (Python
# 3.12, torch 2.11.0+cu130, transformers 5.17, no network), split into three chunks that each fit one
# command's 64 MiB transfer beside the working tree. Unlike the dense payload it keeps vLLM's fused-MoE
# kernels (`vllm/_moe_C_stable_libtorch.abi3.so`: MoE models) and adds compressed-tensors 0.17.0 and
# loguru (`--quantization fp8` imports them). FlashAttention 2 (Hopper runs FA3), the Rust front end and
# deep_gemm builds for other Pythons are left out.
#
# Usage (from the repository root; about 3 minutes on 2 cores):
#     echo /.carry/ >> .git/info/exclude
#     bash benchmarks/real_vllm/classes_payload.sh .carry   # -> .carry/part1, part2 (58 MiB each), part3
# then, on the host, benchmarks/real_vllm/classes_host.sh (its header says which chunk goes with which command).
set -euo pipefail
DEST=${1:-.carry}
PY=${PY:-/root/.pyenv/versions/3.12.1/bin/python}
W=$(mktemp -d); SITE=$W/site
trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64
 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
PKGS="vllm==0.26.0 annotated-types==0.8.0 apache-tvm-ffi==0.1.10 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0
 depyf==0.20.0 dill==0.4.1 distro==1.9.0 fastapi==0.136.3 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0
 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3
 model-hosting-container-standards==0.1.16 msgspec==0.23.0 openai==2.54.0 openai-harmony==0.0.8 outlines_core==0.2.14
 partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4
 pydantic-core==2.50.5 python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0
 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 typing-inspection==0.4.5 uvicorn==0.54.0
 watchfiles==1.3.0 xgrammar==0.2.7 compressed-tensors==0.17.0 loguru"
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps $PLAT -d "$W/whl" $PKGS 2>&1 | grep -v "is ignored" || true
$PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$W"/whl/*.whl 2>&1 | grep -v "as the 'root' user" || true
[ -f "$SITE/vllm/_moe_C_stable_libtorch.abi3.so" ] && [ -d "$SITE/compressed_tensors" ] || { echo "install failed"; exit 1; }
rm -rf "$SITE"/bin "$SITE"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$SITE"/vllm/vllm-rs \
       "$SITE"/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
tar -C "$W" -cf - site | xz -9 -T2 > "$W/payload.tar.xz"
mkdir -p "$DEST/part1" "$DEST/part2" "$DEST/part3"
split -b 58M -d -a 2 "$W/payload.tar.xz" "$W/payload.tar.xz."
for i in 1 2 3; do mv "$W/payload.tar.xz.0$((i - 1))" "$DEST/part$i/"; done
[ ! -e "$W/payload.tar.xz.03" ] || { echo "the payload outgrew three chunks"; exit 1; }
sha256sum "$W/payload.tar.xz"; ls -l "$DEST"/part1 "$DEST"/part2 "$DEST"/part3
