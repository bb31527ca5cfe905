#!/usr/bin/env bash
# The performance check for one H100/H200-class GPU, in at most 8 minutes (BUDGET_S), the parts
# in the order of what the figures are for (issue 21's table), each cut to the time that is left:
#   1. in the background, compile_cache: every compiled row's configuration of MODELS x MODES
#      compiled once in parallel processes, so the timed compiled rows load their kernels from
#      torch's on-disk caches (cold, resnet50 took about 100 s per precision on an H200);
#      meanwhile the no-sync check (pytest -m gpu: the
#      Trainer loop under torch.cuda.set_sync_debug_mode("error"), the GPU decode test) and the
#      synthetic JPEG ImageFolder the feed and peer parts read (IMG_SIZE px, 20 batches);
#   2. overhead: amp_lab step / bare loop, MODELS[0] (resnet50), every mode of MODES;
#   3. throughput_compiled_<model>: torch.compile on, every mode (resnet50 is channels_last);
#   4. compile_step: STEP_MODEL bf16 with trainer.compile=step, when this checkout has that
#      option (else recorded as skipped);
#   5. feed: MODELS[0] bf16 on synthetic data, then on the JPEG folder decoded by PIL in
#      FEED_WORKERS loader workers (data.decode=cpu), then on the GPU (data.decode=gpu):
#      samples/s and throughput/data_share, i.e. which one bounds the run;
#   6. peer: timm's own train.py (PEER_SCRIPT) against amp_lab, MODELS[0] bf16, on the JPEG
#      folder, PEER_EPOCHS epochs, whole runs; skipped when PEER_SCRIPT is not set;
#   7. fp8: FP8_MODELS x bf16 and fp8 (torchao tensorwise), then fp8 rowwise, compiled (cold:
#      the first step is the compilation), batch FP8_BATCH_SIZE, with how many Linear layers
#      torchao converted;
#   8. throughput_eager and overhead_full (diagnostics=full), in the time that is left.
# The limits add up to about 12 minutes; with the default 8-minute budget the last parts are cut or
# skipped (status.txt says which, each one command away); BUDGET_S=590 fits a 10-minute slot.
# The benchmark rewrites its bench.json/bench.md after every measurement, so a part cut short
# keeps what it measured. Everything lands in OUT_DIR: status.txt (exit code and elapsed time
# per part, or why it was skipped), one .log per part, one folder per benchmark and gpu_check.md
# (all tables, with date and device) at the end.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default: $OUT, else outputs/gpu_check/DATE_TIME)
# Settings from the environment (defaults in brackets):
#   PYTHON      the interpreter [.venv/bin/python, else python3]
#   MODELS      timm models; overhead, feed and peer use the first [resnet50 vit_base_patch16_224]
#   MODES       precision modes, the key ones first [bf16 fp16 fp32]
#   STEP_MODEL  the compile_step part's model [vit_base_patch16_224]
#   FP8_MODELS  [vit_base_patch16_224 vit_large_patch16_224 vit_huge_patch14_224]
#   FP8_BATCH_SIZE  the fp8 table's batch [64]
#   BATCH_SIZE, IMG_SIZE   [128, 224]: smaller for a smaller GPU
#   PEER_SCRIPT timm's train.py from a checkout of timm (pip's timm wheel does not ship it, so
#               carry the file to the GPU machine and name it here) [unset: peer skipped]
#   PEER_EPOCHS [2]
#   STEPS, WARMUP   timed and warm-up steps of the throughput, compile and feed parts [20, 5]
#   OVERRIDES   amp_lab overrides added to every part's runs (not to the peer's train.py), e.g.
#               +model.kwargs.depth=1: a one-block model compiles in a fraction of the time [unset]
#   OVERHEAD_STEPS  steps per overhead round, also the runs' log interval [10]
#   FEED_WORKERS  loader workers of the feed and peer parts [the CPUs, at most 16]
#   IMAGES_DIR  where the synthetic JPEG folder is written [a temporary folder, removed at the end]
#   BUDGET_S    seconds for all parts [470]
#   LIMIT_SCALE each part's time limit multiplied by it [1; 3 with DEVICE=cpu]
#   DEVICE      [cuda]; cpu runs the same parts on the CPU, to try the flow before GPU time is
#               spent (fp8 emulated and eager there, inductor's C++ kernels unvectorised:
#               TORCHINDUCTOR_VEC_ISA_OK=0 unless set), e.g. DEVICE=cpu MODELS=test_vit
#               MODES="fp32 bf16" STEP_MODEL=test_vit FP8_MODELS=test_vit FP8_BATCH_SIZE=4 BATCH_SIZE=4 IMG_SIZE=16
#               STEPS=4 WARMUP=1 OVERHEAD_STEPS=2 OVERRIDES=+model.kwargs.depth=1
#               BUDGET_S=1200
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
  local name=$1 limit=$(($2 * LIMIT_SCALE))
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
# the limits are a GPU's; a CPU dry run compiles and trains the tiny models more slowly
LIMIT_SCALE=${LIMIT_SCALE:-$([ "$DEVICE" = cpu ] && echo 3 || echo 1)}
read -ra MODELS <<< "${MODELS:-resnet50 vit_base_patch16_224}"
read -ra MODES <<< "${MODES:-bf16 fp16 fp32}"  # key modes first: a part cut short has them
STEP_MODEL=${STEP_MODEL:-vit_base_patch16_224}
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
if ! "$PYTHON" -c "import benchmarks.bench" 2> "$OUT_DIR/import.log"; then  # fail in seconds
  echo "gpu_check: error: $PYTHON cannot import amp_lab ($(tail -n 1 "$OUT_DIR/import.log"));" \
    "install the project with 'pip install -e .' first" >&2
  exit 2
fi
if [ -n "${PEER_SCRIPT:-}" ] && [ ! -f "$PEER_SCRIPT" ]; then
  echo "gpu_check: error: PEER_SCRIPT=$PEER_SCRIPT is not a file; name timm's train.py from a" \
    "checkout of timm (carried to this machine), or unset PEER_SCRIPT to skip the peer part" >&2
  exit 2
fi
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true
rm -f "$OUT_DIR/status.txt"

BENCH=("$PYTHON" -m benchmarks.bench --device "$DEVICE" --batch-size "$BATCH_SIZE"
  --img-size "$IMG_SIZE")
OVR=(trainer.progress=false)  # every part's --override list starts with these
read -ra EXTRA <<< "${OVERRIDES:-}"
OVR+=("${EXTRA[@]}")
NOTE=""
if ! "$PYTHON" -c "import wandb" 2> /dev/null; then  # the default telemetry logs to W&B offline
  OVR+=(logger.mode=disabled)
  NOTE="wandb is not installed here: every run used logger.mode=disabled"
fi
FP8_DEFAULT="vit_base_patch16_224 vit_large_patch16_224 vit_huge_patch14_224"
read -ra FP8_MODELS <<< "${FP8_MODELS:-$FP8_DEFAULT}"
FP8_OVR=()
FP8_COMPILE=on
if [ "$DEVICE" = cpu ]; then  # no float8 matmuls on a CPU: torchao's emulation, uncompiled
  FP8_OVR=(precision.fp8_emulate=true)
  FP8_COMPILE=off
  # inductor's C++ kernels unvectorised: g++ builds them in a third of the time (the one-block
  # test_vit's cold compile, 2-core CPU, torch 2.14: 13 s instead of 38 s, compile=step 22 s
  # instead of 47 s); the flow is the same
  export TORCHINDUCTOR_VEC_ISA_OK=${TORCHINDUCTOR_VEC_ISA_OK:-0}
fi
FEED_WORKERS=${FEED_WORKERS:-$("$PYTHON" -c "import os; print(min(16, os.cpu_count() or 1))")}
PEER_EPOCHS=${PEER_EPOCHS:-2}
# One compile process per 16 GiB of GPU memory (per core on the CPU), at most one per
# configuration: each runs its configuration's steps at batch 128 (peaks of 7-17 GB on the H200).
# (torch imported on a GPU only: a CPU dry run spares the seconds it takes to import)
JOBS=$("$PYTHON" -c "import os
if '$DEVICE' == 'cuda':
    import torch
    n = torch.cuda.get_device_properties(0).total_memory // (16 << 30)
else:
    n = os.cpu_count()
print(max(1, min(n, ${#MODELS[@]} * ${#MODES[@]})))")
# the same in compile_cache and the compiled rows: same graphs
TIMED=(--steps "${STEPS:-20}" --warmup "${WARMUP:-5}")
# the overhead's rounds: its steps are the runs' log interval, the one step that syncs
OVERHEAD_STEPS=${OVERHEAD_STEPS:-10}
OVERHEAD=(--steps "$OVERHEAD_STEPS" --rounds 3)
FP8_TIMED=(--steps 10 --warmup 3 --batch-size "${FP8_BATCH_SIZE:-64}")  # vit_huge: ~60 GB at 64
FP8_SETS=("bf16 fp8|precision.fp8_recipe=tensorwise" "fp8|precision.fp8_recipe=rowwise")
if [ -z "${IMAGES_DIR:-}" ]; then
  IMAGES_DIR=$(mktemp -d)
  trap 'rm -rf "$IMAGES_DIR"' EXIT
fi
# Limits from the H200 run of 2026-11-30 (docs/gpu_check) where they exist; the feed, peer,
# compile_step and fp8 parts had not run on a GPU when these were set.
part compile_cache 150 "${BENCH[@]}" --parts compile_cache --models "${MODELS[@]}" \
  --precisions "${MODES[@]}" "${TIMED[@]}" --jobs "$JOBS" --override "${OVR[@]}" \
  --out "$OUT_DIR/compile_cache" &
part no_sync 120 "$PYTHON" -m pytest -m gpu tests/test_hot_path.py \
  tests/components/test_device_decode.py -q -p no:cacheprovider
part images 60 "$PYTHON" -m benchmarks.image_folder "$IMAGES_DIR" --size "$IMG_SIZE" \
  --train $((20 * BATCH_SIZE)) --val "$BATCH_SIZE"
wait  # nothing timed runs next to the compile processes
part overhead 80 "${BENCH[@]}" --parts overhead --models "${MODELS[0]}" --variants default \
  --precisions "${MODES[@]}" "${OVERHEAD[@]}" \
  --override "${OVR[@]}" trainer.log_every="$OVERHEAD_STEPS" --out "$OUT_DIR/overhead"
for model in "${MODELS[@]}"; do
  part "throughput_compiled_$model" 45 "${BENCH[@]}" --parts throughput --models "$model" \
    --precisions "${MODES[@]}" --compile on "${TIMED[@]}" --override "${OVR[@]}" \
    --out "$OUT_DIR/throughput_compiled_$model"
done
if "$PYTHON" -c "from amp_lab.compose import compose_settings as c; c(['trainer.compile=step'])" \
    2> /dev/null; then
  part compile_step 60 "${BENCH[@]}" --parts throughput --models "$STEP_MODEL" \
    --precisions bf16 --compile on "${TIMED[@]}" --override "${OVR[@]}" trainer.compile=step \
    --out "$OUT_DIR/compile_step"
else
  echo "compile_step: skipped, this checkout has no trainer.compile=step" \
    | tee -a "$OUT_DIR/status.txt"
fi
part feed 50 "${BENCH[@]}" --parts feed --models "${MODELS[0]}" --precisions bf16 \
  "${TIMED[@]}" --data-dir "$IMAGES_DIR" --workers "$FEED_WORKERS" --override "${OVR[@]}" \
  --out "$OUT_DIR/feed"
if [ -n "${PEER_SCRIPT:-}" ]; then
  part peer 100 "${BENCH[@]}" --parts peer --peer-script "$PEER_SCRIPT" --models "${MODELS[0]}" \
    --precisions bf16 --epochs "$PEER_EPOCHS" --rounds 1 --data-dir "$IMAGES_DIR" \
    --workers "$FEED_WORKERS" --override "${OVR[@]}" --out "$OUT_DIR/peer"
else
  echo "peer: skipped, PEER_SCRIPT is not set (PEER_SCRIPT=path/to/timm/train.py)" \
    | tee -a "$OUT_DIR/status.txt"
fi
i=0
for set in "${FP8_SETS[@]}"; do
  read -ra modes <<< "${set%%|*}"
  part "fp8_$i" $((90 - 30 * i)) "${BENCH[@]}" --parts throughput --models "${FP8_MODELS[@]}" \
    --precisions "${modes[@]}" --compile "$FP8_COMPILE" "${FP8_TIMED[@]}" \
    --override "${OVR[@]}" "${FP8_OVR[@]}" "${set##*|}" --out "$OUT_DIR/fp8_$i"
  i=$((i + 1))
done
part throughput_eager 40 "${BENCH[@]}" --parts throughput --models "${MODELS[@]}" \
  --precisions "${MODES[@]}" --compile off "${TIMED[@]}" --override "${OVR[@]}" \
  --out "$OUT_DIR/throughput_eager"
part overhead_full 30 "${BENCH[@]}" --parts overhead --models "${MODELS[0]}" \
  --variants diagnostics=full --precisions "${MODES[0]}" "${OVERHEAD[@]}" \
  --override "${OVR[@]}" trainer.log_every="$OVERHEAD_STEPS" --out "$OUT_DIR/overhead_full"

{
  echo "# amp_lab GPU check — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  if [ "$DEVICE" = cpu ]; then
    echo "- device: CPU ($(uname -m))"
  else
    echo "- device: $("$PYTHON" -c "import torch; print(torch.cuda.get_device_name())")"
  fi
  echo "- command: \`scripts/gpu_check.sh $*\` ($((SECONDS - START))s)"
  echo "- settings: DEVICE=$DEVICE MODELS=\"${MODELS[*]}\" MODES=\"${MODES[*]}\"" \
    "FP8_MODELS=\"${FP8_MODELS[*]}\" BATCH_SIZE=$BATCH_SIZE IMG_SIZE=$IMG_SIZE" \
    "BUDGET_S=$BUDGET FEED_WORKERS=$FEED_WORKERS PEER_SCRIPT=${PEER_SCRIPT:-unset}" \
    "OVERRIDES=\"${EXTRA[*]}\"," \
    "$JOBS compile jobs"
  [ -n "$NOTE" ] && echo "- note: $NOTE"
  echo
  echo '```'
  cat "$OUT_DIR/status.txt"
  echo '```'
  grep -E "passed|failed|error|skipped" "$OUT_DIR/no_sync.log" | tail -n 1 | sed 's/^/no-sync check: /'
  for name in compile_cache overhead \
      "${MODELS[@]/#/throughput_compiled_}" compile_step feed peer fp8_0 fp8_1 \
      throughput_eager overhead_full; do  # in the order they ran
    md="$OUT_DIR/$name/bench.md"
    [ -f "$md" ] && { echo; sed 's/^#/##/' "$md"; }  # each heading one level down
  done
} > "$OUT_DIR/gpu_check.md"
echo "written: $OUT_DIR/gpu_check.md ($((SECONDS - START))s)"
