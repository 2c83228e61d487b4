#!/usr/bin/env bash
# Start a local MLflow tracking server for servetune studies.
#   bash infra/local/mlflow-server.sh [RUNS_DIR] [PORT]
# Point a study at it with `tracking: {mlflow_uri: http://127.0.0.1:5000}`.
# Binds to 127.0.0.1 only; set MLFLOW_HOST to change that deliberately.
# Backend: SQLite under RUNS_DIR, or MLFLOW_BACKEND_STORE_URI (e.g. postgresql+psycopg://...,
# as infra/local/stack.sh sets it); artifacts go through the server into RUNS_DIR/mlartifacts.
set -euo pipefail
RUNS_DIR=${1:-servetune-runs}
PORT=${2:-5000}
mkdir -p "$RUNS_DIR/mlartifacts"
exec mlflow server --host "${MLFLOW_HOST:-127.0.0.1}" --port "$PORT" --workers 1 \
  --backend-store-uri "${MLFLOW_BACKEND_STORE_URI:-sqlite:///$RUNS_DIR/mlflow.db}" \
  --artifacts-destination "$RUNS_DIR/mlartifacts" --serve-artifacts
