#!/usr/bin/env bash
# Start a local MLflow tracking server for servetune studies.
#   bash infra/local/mlflow-server.sh [RUNS_DIR] [PORT]
# Point a study at it with `tracking: {mlflow_uri: http://127.0.0.1:5000}`.
# Binds to 127.0.0.1 only; set MLFLOW_HOST to change that deliberately.
set -euo pipefail
RUNS_DIR=${1:-servetune-runs}
PORT=${2:-5000}
mkdir -p "$RUNS_DIR/mlartifacts"
exec mlflow server --host "${MLFLOW_HOST:-127.0.0.1}" --port "$PORT" --workers 1 \
  --backend-store-uri "sqlite:///$RUNS_DIR/mlflow.db" \
  --artifacts-destination "$RUNS_DIR/mlartifacts" --serve-artifacts
