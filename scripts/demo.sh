#!/usr/bin/env bash
# Quick start: install into .venv, export the bundled demo Neva (demo/neva_demo.nemo), serve it with Triton on
# loopback, ask it about bundled images through scripts/query.py, then stop the server.
# PORT (default 8000) sets the HTTP port; gRPC uses PORT+1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate

port=${PORT:-8000}
repo=$(mktemp -d)
python scripts/deploy_triton.py --config configs/demo.yaml --visual_checkpoint demo/neva_demo.nemo \
  --triton_model_repository "$repo/engine" --triton_port "$port" --grpc_port "$((port + 1))" >"$repo/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT

echo "exporting and starting the server (log: $repo/server.log) ..."
until curl -sf "http://127.0.0.1:$port/v2/health/ready" >/dev/null; do
  if ! kill -0 "$server" 2>/dev/null; then
    echo "the server stopped; its log:" >&2
    cat "$repo/server.log" >&2
    exit 1
  fi
  sleep 1
done

for image in demo/images/red_circle.png demo/images/blue_triangle.png; do
  for question in "What shape is this?" "What color is the shape?"; do
    answer=$(python scripts/query.py -u "127.0.0.1:$port" -mn demo -mt neva -im "$image" -int "$question")
    echo "$image | $question -> $answer"
  done
done
