#!/usr/bin/env bash
# remat side by side with PyTorch's own options on one CUDA GPU (benchmarks/frontier.py --device
# cuda): peaks from the caching allocator's counters, wall-clock step times with synchronisation,
# models of the sizes people train, at sequence 2048, batch 4, bf16 parameters, AdamW:
#   gpt       remat's built-in GPT in the GPT-2 medium shape (24 x 1024, vocab 50304)
#   hf-gpt2   transformers GPT2LMHeadModel in the GPT-2 large shape (36 x 1280)
#   hf-llama  transformers LlamaForCausalLM in the Llama-3.2-1B shape (16 x 2048, GQA 32/8,
#             vocab 128256, tied embeddings)
# (built from configs, nothing downloaded; --models llama,cnn add the built-in Llama-1B shape and a
# ResNet-18-like ConvNet at 224x224, batch 64).
#
#   benchmarks/gpu.sh [more frontier.py options]        e.g. benchmarks/gpu.sh --models gpt
#
# Sized to finish within 5 minutes on one H100/H200-class GPU: torch.compile gets 60 s per compile
# and 150 s for the whole run (what is not compiled by then says so in its table), and the run is
# stopped at LIMIT_S=290 s; the tables of the models finished by then are already written.
# Results: $OUT (default bench-out/gpu/): <model>.md/.json/.png and README-table.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-out/gpu}
MODELS=${MODELS:-gpt,hf-gpt2,hf-llama}
LIMIT_S=${LIMIT_S:-290}

"$PY" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu.sh: no CUDA device here (torch.cuda.is_available() is False); "
             "run benchmarks/frontier.py for the CPU benchmark")
print(f"gpu.sh: {torch.cuda.get_device_name()}, torch {torch.__version__}")
EOF

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# SIGINT first, so Python unwinds (a model cut short leaves no half-written files), then KILL.
exec timeout --signal=INT --kill-after=20 "$LIMIT_S" \
    "$PY" benchmarks/frontier.py --device cuda --models "$MODELS" --out "$OUT" \
    --repeats 5 --compile-timeout 60 --compile-total 150 "$@"
