#!/usr/bin/env bash
# One GPU, the production settings: bf16 mixed precision, FSDP2 on one rank, torch.compile on each block.
# For `small` and for a reduced-depth `zaya1-base` (the full width, vocabulary and expert shapes, 4 of its
# 40 blocks, so that it fits one device with its optimizer state) it trains a few dozen steps through
# `zaya train` on a dataset built from the Python standard library, then prints per model: tokens/s per GPU,
# MFU against the device's bf16 peak (the trainer's table), peak memory, and the optimizer's share of a step
# (Muon's Newton-Schulz is nearly all of it; AdamW is elementwise), as medians over the steady steps.
#
#   bash benchmarks/gpu_step.sh            # PYTHON=... to choose the interpreter, STEPS=... the step count
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS=${STEPS:-40}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PY" - <<'PY'
import datetime, platform, torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"# gpu_step.sh  date {datetime.date.today()}  device {name}  torch {torch.__version__}  "
      f"host {platform.node()}")
if not torch.cuda.is_available():
    raise SystemExit("this script measures a GPU; none is visible")
PY

"$PY" -m zaya.cli data build --input stdlib --out "$work/data" --vocab-size 8192 --val-fraction 0.01 >/dev/null

run() {  # name, preset, seq_len, micro batch, extra [model] lines
  local name=$1 preset=$2 seq=$3 batch=$4 model_extra=$5
  cat > "$work/$name.toml" <<TOML
[model]
preset = "$preset"
$model_extra
[data]
path = "$work/data"
seq_len = $seq
[train]
max_steps = $STEPS
micro_batch_size = $batch
global_batch_size = $batch
precision = "bf16"
compile = true
eval_every = 0
[checkpoint]
dir = "$work/ckpt-$name"
every = 100000
[logging]
log_every = 1
tensorboard = false
progress = false
TOML
  "$PY" -m zaya.cli train "$work/$name.toml" --run-dir "$work/run-$name" >"$work/$name.log" 2>&1 \
    || { tail -n 30 "$work/$name.log"; exit 1; }
  "$PY" - "$work/run-$name/metrics.jsonl" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steady = rows[len(rows) // 4:]  # compilation and warm-up fall in the first quarter
median = lambda key: statistics.median(r[key] for r in steady)
share = statistics.median(r["optimizer_time"] / r["step_time"] for r in steady)
memory = max(max(r["peak_memory_bytes"]) for r in steady)
print(f"{sys.argv[2]:<22} tokens/s per GPU {median('tokens_per_s'):>10,.0f}   MFU {median('mfu'):6.1%}   "
      f"peak memory {memory / 2**30:6.1f} GiB   optimizer (Muon + AdamW) {share:5.1%} of a step   "
      f"({len(steady)} steady steps of {len(rows)})")
PY
}

run small small 2048 8 ""
run zaya1-base-4-blocks zaya1-base 4096 2 "num_hidden_layers = 4"
