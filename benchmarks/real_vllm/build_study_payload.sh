#!/bin/bash
# CPU-side (no GPU needed): build the study bundle for the H200 host, the Python packages that
# `servetune tune` needs there and the host lacks (ray, optuna, mlflow-skinny and their closure),
# as one xz archive that travels beside the vLLM payload (shared/gpu/build_payload.sh).
#
# The host (Python 3.12.3, torch 2.11, no network) already has numpy, pandas, pyarrow, pyyaml,
# aiohttp, matplotlib, requests, protobuf, grpcio, click, filelock, msgpack, jinja2, markupsafe,
# psutil, tqdm, zipp, ...; the vLLM payload in /tmp/site adds pydantic, fastapi, starlette,
# uvicorn, jsonschema, cachetools, .... This bundle carries the rest, and nothing that either of
# them has, so the order of /tmp/site and /tmp/studysite on PYTHONPATH never picks a version
# (cachetools, mlflow's one overlap, is the fallback when /tmp/site is absent; see run_study_on_gpu.sh).
#
# Usage (from the repository root; about 2 minutes on 2 cores):
#     echo /.gpuwheels/ >> .git/info/exclude
#     bash benchmarks/real_vllm/build_study_payload.sh            # -> .gpuwheels/studysite.tar.xz
#     PY=/path/to/python3.12 bash benchmarks/real_vllm/build_study_payload.sh .gpuwheels
# Wheels are cached outside the tree (WHEEL_CACHE, default ~/.cache/servetune/study-wheels), so a
# re-run downloads nothing and DEST holds only the archive (DEST travels whole with `carry`).
set -euo pipefail
DEST=${1:-.gpuwheels}
PY=${PY:-/root/.pyenv/versions/3.12.1/bin/python}
LIMIT_MIB=${LIMIT_MIB:-38}
W=$(mktemp -d); SITE=$W/studysite
trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64
 --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
# What the host lacks, pinned to the versions servetune is tested with (.venv). Requires-Dist of
# each, extras skipped, host and vLLM-payload packages left out:
#   ray: click filelock jsonschema msgpack packaging protobuf pyyaml requests (+ vendored aiohttp's
#        deps: aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna)  -> all there
#   optuna: alembic colorlog numpy packaging sqlalchemy tqdm pyyaml
#   sqlalchemy: typing-extensions;  alembic: sqlalchemy mako typing-extensions;  mako: markupsafe
#   mlflow-skinny (holds the SqlAlchemyStore and its alembic migrations, so sqlite:// tracking
#        works without the full mlflow): anyio cachetools<8 click cloudpickle databricks-sdk fastapi
#        gitpython importlib_metadata opentelemetry-{api,proto,sdk} packaging protobuf pydantic
#        python-dotenv pyyaml requests sqlparse starlette typing-extensions uvicorn
#   databricks-sdk: certifi requests google-auth protobuf urllib3;  google-auth: pyasn1-modules
#        cryptography;  cryptography: cffi;  cffi: pycparser;  pyasn1-modules: pyasn1
#   gitpython: gitdb;  gitdb: smmap;  importlib_metadata: zipp
#   opentelemetry-sdk: opentelemetry-api opentelemetry-semantic-conventions typing-extensions
#   opentelemetry-proto: protobuf>=5
PKGS="ray==2.60.0 optuna==5.0.0 mlflow-skinny==3.17.2 sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3
 colorlog==6.12.0 cachetools==7.3.3 databricks-sdk==0.162.0 google-auth==2.63.0 pyasn1==0.6.5
 pyasn1-modules==0.4.2 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 gitpython==3.2.1 gitdb==4.0.12
 smmap==5.0.3 importlib-metadata==9.1.0 opentelemetry-api==1.45.2 opentelemetry-proto==1.45.2
 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 python-dotenv==1.2.4 sqlparse==0.6.1"

WHEEL_CACHE=${WHEEL_CACHE:-$HOME/.cache/servetune/study-wheels}
mkdir -p "$WHEEL_CACHE"
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps $PLAT -d "$WHEEL_CACHE" $PKGS 2>&1 | grep -v "is ignored" || true
# shellcheck disable=SC2086
$PY -m pip install -q --no-index --find-links "$WHEEL_CACHE" --no-deps --no-compile --target "$SITE" $PKGS 2>&1 \
  | grep -v "Running pip as the 'root' user" || true
[ -f "$SITE/ray/_raylet.so" ] && [ -d "$SITE/optuna" ] && [ -d "$SITE/mlflow" ] || { echo "install failed"; exit 1; }

# Trim what `ray.init(include_dashboard=False)` + actors never load:
#  - ray/jars: Java workers (34 MB);  ray/dashboard/client: the dashboard web UI (9 MB, js + maps);
#  - the Ray libraries servetune does not use (rllib, tune, train, data, serve, llm, workflow);
#    core Ray imports none of them (the minimal dashboard agent neither: verified by
#    run_study_on_gpu.sh's bundle check and the host-like venv test);
#  - console scripts (their shebangs name this machine's python) and bytecode caches.
rm -rf "$SITE"/bin "$SITE"/ray/jars "$SITE"/ray/dashboard/client \
       "$SITE"/ray/rllib "$SITE"/ray/tune "$SITE"/ray/train "$SITE"/ray/data "$SITE"/ray/serve \
       "$SITE"/ray/llm "$SITE"/ray/workflow
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$SITE" -name '*.js.map' -delete
# The three Ray binaries carry full symbol tables (34 MB of 120); only their dynamic symbols are
# used at run time (symbols would only name frames in a Ray crash backtrace).
if command -v strip >/dev/null; then
  strip --strip-unneeded "$SITE"/ray/_raylet.so "$SITE"/ray/core/src/ray/gcs/gcs_server \
        "$SITE"/ray/core/src/ray/raylet/raylet
fi
printf '%s\n' $PKGS > "$SITE/STUDYSITE_PACKAGES.txt"

# The pieces the study needs must have survived the trim (imports are tested on the host by
# run_study_on_gpu.sh before the study starts, and here in a host-like venv, see the report).
for f in ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet ray/dashboard/agent.py \
         ray/_private/runtime_env/agent/main.py optuna/storages/_rdb/alembic.ini \
         mlflow/store/tracking/sqlalchemy_store.py mlflow/store/db_migrations/alembic.ini alembic/__init__.py; do
  [ -e "$SITE/$f" ] || { echo "missing after the trim: $f"; exit 1; }
done

mkdir -p "$DEST"
tar -C "$W" -cf - studysite | xz -9 -T2 > "$DEST/studysite.tar.xz"
SIZE=$(stat -c %s "$DEST/studysite.tar.xz")
echo "studysite: $(du -sh "$SITE" | cut -f1) unpacked, $DEST/studysite.tar.xz $SIZE bytes ($((SIZE / 1048576)) MiB)"
sha256sum "$DEST/studysite.tar.xz"
if [ "$SIZE" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "studysite.tar.xz is over $LIMIT_MIB MiB: send it in a command of its own (see run_study_on_gpu.sh)"; exit 5
fi
