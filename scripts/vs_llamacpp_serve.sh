#!/usr/bin/env bash
# lmforge serve against llama.cpp's llama-server over HTTP (issue 25): for each GGUF file of the random
# 300M Llama that scripts/vs_llamacpp.py wrote, both servers up on the same file with the same threads,
# then `lmforge bench serve --against` runs the same streamed workload on each at concurrency 1 and 16.
#   scripts/vs_llamacpp_serve.sh LLAMA_SERVER MODEL_DIR OUT [TYPES] [PROMPTS_C1] [PROMPTS_C16]
#   e.g. scripts/vs_llamacpp_serve.sh /opt/llamacpp/.../build/bin/llama-server runs/vs-llamacpp/random-llama-300m \
#        runs/vs-llamacpp "bf16 q8_0 q4_0" 12 32
# Q8_0/Q4_0 run lmforge with --quant-activations int8 (llama.cpp's scheme); LMFORGE_QA=none for the exact path.
# A TYPES entry that is a .gguf path runs that file with lmforge's default flags (what a user gets), e.g.
#   scripts/vs_llamacpp_serve.sh LLAMA_SERVER - runs/vs-types "runs/gguf/random-1b-Q4_K_M.gguf runs/gguf/random-1b-Q8_0.gguf"
set -euo pipefail
LLAMA_SERVER=$1 MODEL_DIR=$2 OUT=$3 TYPES=${4:-"bf16 q8_0 q4_0"} N1=${5:-12} N16=${6:-32}
THREADS=${THREADS:-2}
LMF=${LMF:-.venv/bin/lmforge}
mkdir -p "$OUT"
wait_up() {  # URL PID LOG
  for _ in $(seq 1 600); do
    curl -sf "$1/v1/models" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited: $3"; tail -20 "$3"; exit 1; }
    sleep 0.5
  done
  echo "no answer from $1"; exit 1
}
for T in $TYPES; do
  F="$MODEL_DIR/model-$T.gguf"
  QA=none; [ "$T" != bf16 ] && QA=${LMFORGE_QA:-int8}
  FLAGS=(--dtype auto --quant-activations "$QA")
  if [ -f "$T" ]; then F=$T; T=$(basename "$T" .gguf); FLAGS=(); fi
  OMP_NUM_THREADS=$THREADS $LMF serve "$F" --port 8000 "${FLAGS[@]}" \
    --served-model-name m > "$OUT/lmforge-$T.log" 2>&1 & LP=$!
  "$LLAMA_SERVER" -m "$F" -t "$THREADS" --port 8080 -c 32768 -np 16 --alias m > "$OUT/llama-server-$T.log" 2>&1 & CP=$!
  trap 'kill $LP $CP 2>/dev/null || true' EXIT
  wait_up http://127.0.0.1:8000 $LP "$OUT/lmforge-$T.log"
  wait_up http://127.0.0.1:8080 $CP "$OUT/llama-server-$T.log"
  for C in 1 16; do
    N=$N1; [ "$C" = 16 ] && N=$N16
    $LMF bench serve --base-url http://127.0.0.1:8000 --model m --against http://127.0.0.1:8080 --against-model m \
      --concurrency "$C" --num-prompts "$N" --workload high-variance --seed 25 --no-progress \
      --out "$OUT/serve-$T-c$C" | tail -12
  done
  kill $LP $CP; wait $LP $CP 2>/dev/null || true
done
