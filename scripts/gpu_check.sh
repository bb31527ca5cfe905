#!/usr/bin/env bash
# The performance check for one H100/H200-class GPU, in at most 8 minutes:
#   1. compile_cache, in the background: every compiled throughput row's configuration compiled
#      once, in parallel processes, so the timed compiled rows load their kernels from torch's
#      on-disk caches (cold, resnet50 took about 100 s per precision to compile on an H200);
#   2. the no-sync check, meanwhile: pytest -m gpu (a real Trainer loop under
#      torch.cuda.set_sync_debug_mode("error") between log steps, fp32/fp16/bf16);
#   3. the overhead check: amp_lab step / bare loop, resnet50, every GPU mode with the default
#      telemetry;
#   4. the throughput table: resnet50 and vit_base_patch16_224 x bf16, fp32, fp16, tf32,
#      torch.compile off, then on (one model per part, so both get their turn);
#   5. the overhead of diagnostics=full (bf16), in the time that is left.
# Each part has a time limit, cut to what is left of the 8 minutes (BUDGET_S, default 470 s);
# the benchmark rewrites its bench.json/bench.md after every measurement, so a part cut short
# keeps what it measured. Everything lands in OUT_DIR: status.txt (exit code and elapsed time
# per part), one .log per part, one folder per benchmark and gpu_check.md (all tables, with date
# and device) at the end.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default: $OUT, else outputs/gpu_check/DATE_TIME)
# Settings from the environment (defaults in brackets):
#   PYTHON      the interpreter [.venv/bin/python, else python3]
#   MODELS      timm models; the overhead check uses the first [resnet50 vit_base_patch16_224]
#   MODES       precision modes, the key ones first [bf16 fp32 fp16 tf32]
#   BATCH_SIZE, IMG_SIZE   [128, 224]: smaller for a smaller GPU
#   BUDGET_S    seconds for all parts [470]
#   DEVICE      [cuda]; cpu runs the same parts on the CPU, to try the flow before GPU time is
#               spent, e.g. DEVICE=cpu MODELS=test_vit MODES="fp32 bf16" BATCH_SIZE=4 IMG_SIZE=16
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT_DIR=${1:-${OUT:-outputs/gpu_check/$(date -u +%Y-%m-%d_%H-%M-%S)}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's amp_lab
START=$SECONDS
BUDGET=${BUDGET_S:-470}  # seconds for all parts: 8 minutes, less the summary at the end

part() {  # part NAME LIMIT_S COMMAND...: run with a time limit, log it, record the exit code
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "$name: skipped, ${left}s of the ${BUDGET}s budget left" | tee -a "$OUT_DIR/status.txt"
    return
  fi
  echo "== $name (limit ${limit}s)"
  rm -rf "${OUT_DIR:?}/$name"  # a benchmark part's folder: no figures left from an earlier run
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc after $((SECONDS - START))s" | tee -a "$OUT_DIR/status.txt"
  tail -n 3 "$OUT_DIR/$name.log"
}

DEVICE=${DEVICE:-cuda}
read -ra MODELS <<< "${MODELS:-resnet50 vit_base_patch16_224}"
read -ra MODES <<< "${MODES:-bf16 fp32 fp16 tf32}"  # key modes first: a part cut short has them
BATCH_SIZE=${BATCH_SIZE:-128}
IMG_SIZE=${IMG_SIZE:-224}
if [ "$DEVICE" != cuda ] && [ "$DEVICE" != cpu ]; then
  echo "gpu_check: error: DEVICE=$DEVICE; use cuda (the default) or cpu" >&2
  exit 2
fi
if [ "$DEVICE" = cuda ] \
    && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: error: $PYTHON cannot import torch or sees no CUDA GPU;" \
    "run this on a GPU machine, or set PYTHON (DEVICE=cpu tries the flow on the CPU)" >&2
  exit 2
fi
if ! "$PYTHON" -c "import amp_lab.bench" 2> "$OUT_DIR/import.log"; then  # fail in seconds
  echo "gpu_check: error: $PYTHON cannot import amp_lab ($(tail -n 1 "$OUT_DIR/import.log"));" \
    "install the project with 'pip install -e .' first" >&2
  exit 2
fi
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true
rm -f "$OUT_DIR/status.txt"

BENCH=("$PYTHON" -m amp_lab.bench --device "$DEVICE" --batch-size "$BATCH_SIZE"
  --img-size "$IMG_SIZE")
NOTE=""
if ! "$PYTHON" -c "import wandb" 2> /dev/null; then  # the default telemetry logs to W&B offline
  BENCH+=(--override logger.mode=disabled)
  NOTE="wandb is not installed here: every run used logger.mode=disabled"
fi
# One compile process per 16 GiB of GPU memory (per core on the CPU), at most one per
# configuration: each runs its configuration's steps at batch 128 (peaks of 7-17 GB on the H200).
JOBS=$("$PYTHON" -c "import os, torch
n = (torch.cuda.get_device_properties(0).total_memory // (16 << 30) if '$DEVICE' == 'cuda'
     else os.cpu_count())
print(max(1, min(n, ${#MODELS[@]} * ${#MODES[@]})))")
TIMED=(--steps 20 --warmup 5)  # the same in compile_cache and the compiled rows: same graphs
# Limits from the H200 run of 2026-11-30 (docs/gpu_check), where the compiled rows still
# compiled cold and the whole table needed about 15 minutes.
part compile_cache 180 "${BENCH[@]}" --parts compile_cache --models "${MODELS[@]}" \
  --precisions "${MODES[@]}" "${TIMED[@]}" --jobs "$JOBS" --out "$OUT_DIR/compile_cache" &
part no_sync 120 "$PYTHON" -m pytest -m gpu tests/test_hot_path.py -q -p no:cacheprovider
wait  # nothing timed runs next to the compile processes
part overhead 110 "${BENCH[@]}" --parts overhead --models "${MODELS[0]}" --variants default \
  --precisions "${MODES[@]}" --steps 10 --rounds 4 --out "$OUT_DIR/overhead"
part throughput_eager 80 "${BENCH[@]}" --parts throughput --models "${MODELS[@]}" \
  --precisions "${MODES[@]}" --compile off "${TIMED[@]}" --out "$OUT_DIR/throughput_eager"
for model in "${MODELS[@]}"; do
  part "throughput_compiled_$model" 60 "${BENCH[@]}" --parts throughput --models "$model" \
    --precisions "${MODES[@]}" --compile on "${TIMED[@]}" \
    --out "$OUT_DIR/throughput_compiled_$model"
done
part overhead_full 40 "${BENCH[@]}" --parts overhead --models "${MODELS[0]}" \
  --variants diagnostics=full --precisions "${MODES[0]}" --steps 10 --rounds 4 \
  --out "$OUT_DIR/overhead_full"

{
  echo "# amp_lab GPU check — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "- device: $("$PYTHON" -c "import platform, torch
print(torch.cuda.get_device_name() if '$DEVICE' == 'cuda' else f'CPU ({platform.machine()})')")"
  echo "- command: \`scripts/gpu_check.sh $*\` ($((SECONDS - START))s)"
  echo "- settings: DEVICE=$DEVICE MODELS=\"${MODELS[*]}\" MODES=\"${MODES[*]}\"" \
    "BATCH_SIZE=$BATCH_SIZE IMG_SIZE=$IMG_SIZE BUDGET_S=$BUDGET, $JOBS compile jobs"
  [ -n "$NOTE" ] && echo "- note: $NOTE"
  echo
  echo '```'
  cat "$OUT_DIR/status.txt"
  echo '```'
  grep -E "passed|failed|error|skipped" "$OUT_DIR/no_sync.log" | tail -n 1 | sed 's/^/no-sync check: /'
  for name in compile_cache overhead throughput_eager "${MODELS[@]/#/throughput_compiled_}" \
      overhead_full; do  # in the order they ran
    md="$OUT_DIR/$name/bench.md"
    [ -f "$md" ] && { echo; sed 's/^#/##/' "$md"; }  # each heading one level down
  done
} > "$OUT_DIR/gpu_check.md"
echo "written: $OUT_DIR/gpu_check.md ($((SECONDS - START))s)"
