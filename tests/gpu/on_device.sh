#!/usr/bin/env bash
# The GPU checks and figures (tests/gpu, bench_decode, bench_engine) on a lent GPU machine,
# one stage per call of the `device` tool, each well inside a call's 10 minutes:
#   bash tests/gpu/on_device.sh headline  # every figure a GPU user asks first, at most 540 s
#                                         # (loadtests/headline): a GPU machine's first call
#   bash tests/gpu/on_device.sh tests   # tests/gpu
#   bash tests/gpu/on_device.sh small   # steady decode and the whole workload, small model
#   bash tests/gpu/on_device.sh 8b      # the same on an 8B-shaped random checkpoint
#   bash tests/gpu/on_device.sh quant   # quantized GEMMs, formats and FP8 KV on CUDA; decode
#                                       # and prefill of bf16, FP8 and AWQ 8B-shaped checkpoints
#   bash tests/gpu/on_device.sh spec    # speculative decoding: speedup against acceptance,
#                                       # small model and 8B-shaped checkpoint
#   bash tests/gpu/on_device.sh lora    # LoRA adapters: CUDA tests, tokens/s over 1, 4 and 16
#                                       # adapters against the base, small model
#   bash tests/gpu/on_device.sh moe     # mixtures of experts: fused kernels at Qwen3-30B-A3B's
#                                       # layer shape, decode at batch 1/32/128, prefill
#   bash tests/gpu/on_device.sh moe-fp8 # the same layers with Qwen3-30B-A3B-FP8's block-FP8
#                                       # experts (held in FP8): decode, prefill
#   bash tests/gpu/on_device.sh gpt-oss # gpt-oss-20b's layers (MXFP4 experts dequantized at
#                                       # load): decode at batch 1/32/128, prefill
#   bash tests/gpu/on_device.sh serving # the serving path over the 8B-shaped engine against
#                                       # the same engine in process: one chat user stage by
#                                       # stage, 64 streams, and the emulated replica beside it
# That machine's image holds torch, triton, transformers, pytest and pytest-xdist: the
# checkout runs from PYTHONPATH. What it lacks (xgrammar) travels as wheels: run
# `bash tests/gpu/device_wheels.sh` here once and name `.whl` in `carry`; they are installed
# under /tmp/site there (without them the grammar test skips; without serving-site.tar.xz,
# Ray Serve and the rest of the app, the headline's HTTP step fails). Each step's log (JSON last) goes to $OUT/<step>.log and its
# tail to the output; a failing step does not stop the next.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/on-device}
mkdir -p "$OUT"
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: rc $? in $((SECONDS - start)) s"
    tail -n 12 "$OUT/$name.log"
}

# The figures: steady decode (overlap and graphs off/on, the sampler at batch 256, rows with
# penalties and logprobs), then the whole workload against HF static and with each of overlap
# and graphs turned off.
figures() {  # figures TAG MODEL HF_BATCH_SIZES
    local tag=$1 model=$2 hf=$3
    local common=(--model "$model" --device "$DEVICE" --dtype "$DTYPE" --json)
    step "$tag-decode64" 280 "$PY" -m loadtests.bench_decode "${common[@]}" --batch 64
    step "$tag-decode256" 280 "$PY" -m loadtests.bench_decode "${common[@]}" --batch 256 \
        --temperature 1.0 --top-p 0.9
    step "$tag-decode64-penalized" 200 "$PY" -m loadtests.bench_decode "${common[@]}" \
        --batch 64 --frequency-penalty 0.5 --logprobs 2
    step "$tag-engine" 400 "$PY" -m loadtests.bench_engine "${common[@]}" --repeat 2 \
        --hf-batch-sizes "$hf"
    for variant in --no-overlap --enforce-eager; do
        step "$tag-engine$variant" 300 "$PY" -m loadtests.bench_engine "${common[@]}" \
            --repeat 2 --skip-hf --skip-static "$variant"
    done
}

if [ -f .whl/serving-site.tar.xz ]; then
    mkdir -p /tmp/site && tar -xJf .whl/serving-site.tar.xz -C /tmp/site
    export PYTHONPATH=$PWD:/tmp/site
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
"$PY" -c "import torch; print(torch.__version__, torch.cuda.is_available() and \
torch.cuda.get_device_name())"
case ${1:-} in
    headline)
        # Its own budget by construction (each step's timeout; they add up to 540 s).
        "$PY" -m loadtests.headline --device "$DEVICE" --dtype "$DTYPE" --out "$OUT" \
            --work /tmp/headline-steps ${QUICK:+--quick} ${ONLY:+--only "$ONLY"}
        ;;
    tests)
        step prebuild 120 "$PY" tests/gpu/prebuild_models.py
        # Alone: it measures the GPU's memory, which parallel workers would share.
        memory=profiled_kv_cache_leaves_room
        step gpu-tests-memory 120 "$PY" -m pytest -q -rfE -p no:cacheprovider tests/gpu -k "$memory"
        step gpu-tests 420 "$PY" -m pytest -q -rfE -p no:cacheprovider -n 4 --timeout 200 \
            tests/gpu -k "not $memory"
        ;;
    small) figures small "${MODEL:-small}" 128 ;;
    8b)
        checkpoint=/tmp/llama3-8b-random
        [ -f "$checkpoint/config.json" ] || step checkpoint-8b 300 "$PY" -m \
            engine.model.random_checkpoint --shape llama3-8b --out "$checkpoint" \
            --dtype "$DTYPE" --device "$DEVICE"
        figures 8b "$checkpoint" 64
        ;;
    quant)
        base=/tmp/llama3-8b-random awq=/tmp/llama3-8b-awq
        step quant-tests 240 "$PY" -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cuda_quant.py
        [ -f "$base/config.json" ] || step checkpoint-8b 240 "$PY" -m \
            engine.model.random_checkpoint --shape llama3-8b --out "$base" --dtype "$DTYPE" \
            --device "$DEVICE"
        [ -f "$awq/config.json" ] || step checkpoint-8b-awq 120 "$PY" -m \
            engine.model.random_checkpoint --shape llama3-8b --out "$awq" --dtype "$DTYPE" \
            --device "$DEVICE" --quant awq
        step quant-bench 400 "$PY" -m loadtests.bench_quant --model "$base" --awq "$awq" \
            --device "$DEVICE" --dtype "$DTYPE" --batches 1,32,128 --kv-cache-gb 8 --json
        ;;
    spec)
        checkpoint=/tmp/llama3-8b-random
        step spec-tests 200 "$PY" -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cuda_spec.py
        step spec-small 240 "$PY" -m loadtests.bench_spec --model small --device "$DEVICE" \
            --dtype "$DTYPE" --max-tokens 128 --json
        [ -f "$checkpoint/config.json" ] || step checkpoint-8b 240 "$PY" -m \
            engine.model.random_checkpoint --shape llama3-8b --out "$checkpoint" \
            --dtype "$DTYPE" --device "$DEVICE"
        step spec-8b 400 "$PY" -m loadtests.bench_spec --model "$checkpoint" --device "$DEVICE" \
            --dtype "$DTYPE" --max-tokens 128 --kv-cache-gb 16 --json
        ;;
    lora)
        step lora-tests 200 "$PY" -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cuda_lora.py
        step lora-small 400 "$PY" -m loadtests.bench_lora --model small --device "$DEVICE" \
            --dtype "$DTYPE" --repeat 2 --json
        ;;
    serving)
        # The headline's checkpoint (a tokenizer with it), made here unless that ran first.
        checkpoint=/dev/shm/dynabatch-llama3-8b
        [ -f "$checkpoint/config.json" ] || step checkpoint-8b 120 "$PY" -m \
            loadtests.headline.checkpoint_step --model "$checkpoint" --device "$DEVICE" \
            --dtype "$DTYPE" --out "$OUT/checkpoint.json"
        common=(--model "$checkpoint" --device "$DEVICE" --dtype "$DTYPE" --kv-cache-gb 8 --json)
        step serving-one 150 "$PY" -m loadtests.bench_serve "${common[@]}" --concurrency 1 \
            --workload random-128-64-16 --chat --trace --repeat 2
        step serving-64 180 "$PY" -m loadtests.bench_serve "${common[@]}" --concurrency 64 \
            --workload random-256-128-512 --chat
        step serving-emulated-64 100 "$PY" -m loadtests.bench_serve --model tiny \
            --emulate Llama-3.1-8B@H100-80GB --concurrency 64 --workload random-256-128-512 \
            --chat --json
        ;;
    moe)
        # Qwen3-30B-A3B's layer shape in 12 layers: the fused kernels' tests at that shape,
        # then decode at batch 1, 32 and 128 (the JSON's roofline counts the experts a step
        # touches) and the whole workload (prefill tokens/s).
        checkpoint=/tmp/qwen3-30b-a3b-12l
        step moe-tests 240 "$PY" -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_cuda_moe.py
        [ -f "$checkpoint/config.json" ] || step checkpoint-moe 300 "$PY" -m \
            engine.model.random_checkpoint --shape qwen3-30b-a3b-12l --out "$checkpoint" \
            --dtype "$DTYPE" --device "$DEVICE"
        for batch in 1 32 128; do
            step "moe-decode$batch" 150 "$PY" -m loadtests.bench_decode --model "$checkpoint" \
                --device "$DEVICE" --dtype "$DTYPE" --batch "$batch" --kv-cache-gb 8 --json
        done
        step moe-engine 300 "$PY" -m loadtests.bench_engine --model "$checkpoint" \
            --device "$DEVICE" --dtype "$DTYPE" --repeat 1 --skip-hf --json
        ;;
    moe-fp8)
        # The `moe` stage's layers in Qwen3-30B-A3B-FP8's layout (experts in 128x128 FP8
        # blocks, routers float), each expert on the block-FP8 GEMM: the same steps as `moe`'s,
        # to set beside them.
        checkpoint=/tmp/qwen3-30b-a3b-12l-fp8
        [ -f "$checkpoint/config.json" ] || step checkpoint-moe-fp8 300 "$PY" -m \
            engine.model.random_checkpoint --shape qwen3-30b-a3b-12l --out "$checkpoint" \
            --dtype "$DTYPE" --device "$DEVICE" --quant fp8-block
        for batch in 1 32 128; do
            step "moe-fp8-decode$batch" 150 "$PY" -m loadtests.bench_decode \
                --model "$checkpoint" --device "$DEVICE" --dtype "$DTYPE" --batch "$batch" \
                --kv-cache-gb 8 --json
        done
        step moe-fp8-engine 300 "$PY" -m loadtests.bench_engine --model "$checkpoint" \
            --device "$DEVICE" --dtype "$DTYPE" --repeat 1 --skip-hf --json
        ;;
    gpt-oss)
        # gpt-oss-20b's layer shape in 12 layers (its CUDA tests are in `moe`): decode at
        # batch 1, 32 and 128 and the whole workload, on triton's sinks and windows.
        checkpoint=/tmp/gpt-oss-20b-12l
        [ -f "$checkpoint/config.json" ] || step checkpoint-gpt-oss 240 "$PY" -m \
            engine.model.random_checkpoint --shape gpt-oss-20b-12l --out "$checkpoint" --tokenizer \
            --dtype "$DTYPE" --device "$DEVICE"
        for batch in 1 32 128; do
            step "gpt-oss-decode$batch" 100 "$PY" -m loadtests.bench_decode \
                --model "$checkpoint" --device "$DEVICE" --dtype "$DTYPE" --batch "$batch" \
                --kv-cache-gb 8 --json
        done
        step gpt-oss-engine 200 "$PY" -m loadtests.bench_engine --model "$checkpoint" \
            --device "$DEVICE" --dtype "$DTYPE" --repeat 1 --skip-hf --json
        ;;
    *) echo "usage: $0 headline|tests|small|8b|quant|spec|lora|serving|moe|moe-fp8|gpt-oss" >&2
       exit 2 ;;
esac
