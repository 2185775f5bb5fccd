#!/usr/bin/env bash
# The GPU work of issues #9 and #25 in three device calls of at most 10 minutes each (read
# ../shared/gpu/README.md first). Here:
#   bash ../shared/gpu/prepare                 # pydantic wheels into .whl/
#   python -m benchmarks.make_shards           # GPT-2-vocabulary shards into .gpu/store
# then three `device run`s, each with carry [".whl", ".gpu"]:
#   1. bash benchmarks/gpu_session.sh tests    the CUDA tests (8 compiling torchrun launches:
#                                              560 s, the whole call)
#   2. bash benchmarks/gpu_session.sh bench    bench_gpu at GPT-2 124M (vocabulary 50257 padded
#      to 50304): a real torchrun run of the gpt2-124m-1gpu recipe timed from its events, next
#      to the in-process trainer and the bare loop (real/benchmark >= 0.97, trainer/bare >= 1.0,
#      MFU >= 45% on an H100), the checkpoint stall, the kernel profile, a Llama-3.2-1B-shaped
#      model with its recipe's engine (tokens/s, MFU); then bench_attention (document attention
#      on flex attention over causal, goal >= 0.9), bench_memory and bench_plan
#   3. bash benchmarks/gpu_session.sh compare  real runs of DDP and FSDP2 with no, selective and
#      full activation checkpointing, and DDP with the chunked cross-entropy: step time over
#      DDP (FSDP2 <= 1.15x, selective <= 1.12x none) and the chunked loss's cost
# Also: all (the three in a row, where a call may take 30 min), explore (bare-loop variants),
#   tuned [bench_gpu's options], e.g. --micro-batch 48 --cross-entropy-chunk 4096.
# Each part has its own time limit inside its call; logs, JSON and summary.txt land in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site .whl/*.whl \
  || { echo "gpu_session: run 'bash ../shared/gpu/prepare' here and carry .whl"; exit 1; }
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
export STOKER_GPU_STORE=${STOKER_GPU_STORE:-file://$PWD/.gpu/store}
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$OUT"
what=${1:-all}
shift $(( $# > 0 ? 1 : 0 ))
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$OUT/gpu.txt" 2>&1

part() {  # part NAME SECONDS COMMAND...: one log per part, its exit status in summary.txt
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

if [ "$what" = tests ] || [ "$what" = all ]; then
  part cuda-tests 560 python3 -m pytest -m cuda tests/training/test_cuda.py -p no:cacheprovider -v -s
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  part bench-gpu 470 python3 -m benchmarks.bench_gpu --store "$STOKER_GPU_STORE" --profile \
    --real-variants ddp:none --real-steps 40 --real-warmup 10 --real-timeout 200 --llama-1b
  # document-aware attention (flex attention, a BlockMask) against causal, the same model (goal >= 0.9)
  # grouped experts at the Qwen3-30B-A3B layer shape, bf16 (issue #52): MFU, and over the loop
  part bench-moe 60 python3 -m benchmarks.bench_moe --gpu-layer
  part bench-attention 60 python3 -m benchmarks.bench_attention --block 2048 --batch 4 --doc-tokens 512 --steps 10
  part bench-memory 80 python3 -m benchmarks.bench_memory \
    --layers 12 --width 768 --block 1024 --batch 16 --vocab 50304 --chunk 4096
  # the plan's memory estimate against max_memory_allocated (GPT-2 124M, a Llama-1B shape)
  part bench-plan 90 python3 -m benchmarks.bench_plan
fi
if [ "$what" = compare ] || [ "$what" = all ]; then  # 7 runs of ~70 s (compile included)
  part compare 570 python3 -m benchmarks.bench_gpu --store "$STOKER_GPU_STORE" --skip-stall \
    --micro-batch "" --real-micro-batch 32 --real-global-batch 128 --real-steps 40 \
    --real-warmup 10 --real-timeout 120 --real-variants \
    ddp:none,ddp:selective,ddp:full,fsdp:none,fsdp:selective,fsdp:full,ddp:none:ce4096
fi
if [ "$what" = explore ]; then
  part explore 580 python3 -m benchmarks.bench_gpu --store "$STOKER_GPU_STORE" --skip-stall \
    --micro-batch "" --explore 32:default,32:default:ce4096,64:default,64:default:ce4096,48:default:cdt
fi
if [ "$what" = tuned ]; then  # ours vs the bare loop, both with the given settings
  part bench-tuned 580 python3 -m benchmarks.bench_gpu --store "$STOKER_GPU_STORE" --skip-stall --profile "$@"
fi
cp -f benchmarks/results/gpu-*.json "$OUT/" 2>/dev/null
exit 0
