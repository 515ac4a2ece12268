#!/usr/bin/env bash
# The MFU ladder on a CUDA machine: doctor (datasheet peaks + measured bandwidth), the quickstart
# data, then `lmforge bench mfu` on the quickstart config at a GPU-sized batch, and the report.
# Usage: scripts/mfu_ladder_gpu.sh [OUT]   (OUT defaults to runs/mfu-gpu; ~5-10 minutes on one GPU)
set -euo pipefail
OUT=${1:-runs/mfu-gpu}
LMFORGE=${LMFORGE:-.venv/bin/lmforge}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.csv"
$LMFORGE doctor --out "$OUT/hardware.json"
export LMFORGE_HOME="$OUT"  # the profile just measured is the one the ladder reads
[ -f "$OUT/packed/manifest.json" ] || {
  $LMFORGE data prepare python-docs --out "$OUT/data" split.val=0.05 split.test=0.05
  $LMFORGE tokenizer train "$OUT/data/splits/train.jsonl" --vocab-size 8192 --out "$OUT/tokenizer"
  $LMFORGE data pack "$OUT/data" --tokenizer "$OUT/tokenizer" --seq-len 256 --out "$OUT/packed"
}
# batch 64 × 256 tokens: the quickstart model is tiny, a GPU needs more rows to fill its SMs
$LMFORGE bench mfu configs/quickstart.yaml data.path="$OUT/packed" train.batch_size=64 train.device=cuda \
  --steps 20 --max-batch 256 --out "$OUT/ladder"
$LMFORGE report "$OUT/ladder" --goal "MFU of the quickstart config on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
  --out "$OUT/report.md"
cat "$OUT/report.md"
