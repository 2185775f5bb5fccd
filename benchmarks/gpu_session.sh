#!/usr/bin/env bash
# The GPU work of issue #9 in one device call (read ../shared/gpu/README.md first). Here:
#   bash ../shared/gpu/prepare                 # pydantic wheels into .whl/
#   python -m benchmarks.make_shards           # GPT-2-vocabulary shards into .gpu/store
# then `device run` with carry [".whl", ".gpu"] and the command
#   bash benchmarks/gpu_session.sh [tests|bench|explore|all]     (default: all)
#   bash benchmarks/gpu_session.sh tuned [bench_gpu's options]   e.g. --micro-batch 48
#        --compile-tuning coordinate-descent --cross-entropy-chunk 4096 (what explore found)
# tests: the CUDA tests. bench: bench_gpu (ours vs the bare loop, MFU, checkpoint stall, where
# the step's kernel time goes) and bench_memory at GPT-2 124M's shape. explore: the bare loop
# at micro-batches 32 and 64, with the chunked cross-entropy, with coordinate-descent tuning.
# Each part has its own time limit so that "all" fits one 600 s call; the logs and the
# benchmark JSON land in $OUT.
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
  part cuda-tests 230 python3 -m pytest -m cuda tests/training/test_cuda.py -p no:cacheprovider -v -s
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  part bench-gpu 280 python3 -m benchmarks.bench_gpu --store "$STOKER_GPU_STORE" --profile
  part bench-memory 80 python3 -m benchmarks.bench_memory \
    --layers 12 --width 768 --block 1024 --batch 16 --vocab 50304 --chunk 4096
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
