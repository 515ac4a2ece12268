#!/usr/bin/env bash
# Engine and serving throughput of two versions of lmforge, interleaved on one idle machine:
#   scripts/ab_bench.sh OLD_REV [ROUNDS] [OUT]
# OLD_REV is checked out into a temporary git worktree and run through PYTHONPATH with this checkout's
# .venv; "new" is the working tree. Each round runs `lmforge bench engine` (100 high-variance
# requests, bf16, 1 thread, lmforge only) and `lmforge bench serve` at concurrency 32 (uniform 128/64,
# 64 prompts) against `lmforge serve` on a random 30M Llama, old then new. Prints output tok/s per run.
set -euo pipefail
OLD_REV=${1:?usage: scripts/ab_bench.sh OLD_REV [ROUNDS] [OUT]}
ROUNDS=${2:-2}
OUT=${3:-runs/ab-bench}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
LM=$ROOT/.venv/bin/lmforge
OLD=$(mktemp -d)/old
git -C "$ROOT" worktree add -f --detach "$OLD" "$OLD_REV" -q
trap 'git -C "$ROOT" worktree remove --force "$OLD"' EXIT
mkdir -p "$OUT"
if [ ! -f "$OUT/lm30m/config.json" ]; then
  "$PY" -c "from pathlib import Path; from lmforge.serve.testing import make_model_with_tokenizer as m; \
m(Path('$OUT/lm30m'), Path('$OUT/tok30m'), vocab_size=8192, hidden_size=512, layers=8, num_attention_heads=8, \
num_key_value_heads=8, max_position_embeddings=2048)"
fi
for round in $(seq 1 "$ROUNDS"); do
  for code in old new; do
    if [ $code = old ]; then export PYTHONPATH=$OLD/src; else unset PYTHONPATH; fi
    OMP_NUM_THREADS=1 "$LM" bench engine --baselines lmforge --num-requests 100 --dtype bfloat16 \
      --out "$OUT/engine-$code-$round" > "$OUT/engine-$code-$round.log" 2>&1
    OMP_NUM_THREADS=1 "$LM" serve "$OUT/lm30m" --port 8765 --served-model-name lm30m --dtype bfloat16 \
      > "$OUT/serve-$code-$round.log" 2>&1 &
    server=$!
    for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8765/health/ready > /dev/null && break; sleep 0.5; done
    OMP_NUM_THREADS=1 "$LM" bench serve --base-url http://127.0.0.1:8765 --workload uniform --input-len 128 \
      --output-len 64 --num-prompts 64 --max-concurrency 32 --seed 5032 --no-progress \
      --out "$OUT/serve-$code-$round" > "$OUT/servebench-$code-$round.log" 2>&1
    kill -TERM $server; wait $server || true
  done
done
unset PYTHONPATH
for f in "$OUT"/engine-*/bench.md; do
  printf '%s engine output tok/s %s\n' "$(basename "$(dirname "$f")")" "$(awk -F'|' '/^\| lmforge /{print $4}' "$f")"
done
for f in "$OUT"/serve-*/bench.md; do
  printf '%s serve c=32 output tok/s %s\n' "$(basename "$(dirname "$f")")" \
    "$(awk -F'|' '/output token throughput/{print $3}' "$f")"
done
