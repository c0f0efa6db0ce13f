#!/usr/bin/env bash
# One lent GPU's checks in one scripted run, in priority order, each stage capped by `timeout` so the
# others still run: gpu-check on every model, the side-by-side bench against the libraries' switches,
# timm's ViT's and two Hugging Face models' allocator histories (the 1-2 KB the card's Hugging Face
# predictions run high: docs/memory.md), tests/planner/test_gpu.py, then the other sized models. About 8
# minutes on an H200 (7 on 2026-11-28, docs/memory.md "On an H200 again", before the Hugging Face
# histories). Results go to $OUT (a device call's output folder) or ./gpu-session-out, as results.tgz,
# snapshots.tgz and log.txt.
#
# The device image's python3 holds a CUDA torch, transformers and timm but not OR-tools or diffusers:
# put their cp312 manylinux wheels in .whl first (ortools, immutabledict, protobuf, diffusers; the pip
# download line is in the device tool's README) and carry .whl with the call.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-session-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
RESULTS=$(mktemp -d)
mkdir -p "$RESULTS/snap"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
  echo "== gpu_check, every model $(date +%T)"
  timeout 80 python3 -m bench.gpu_check --deadline-s 45 --out "$RESULTS/gpu_check.json"
  echo "rc=$? == compare, the switches $(date +%T)"
  timeout 180 python3 -m bench.compare --eager-only --device cuda --jobs 1 \
    --models hf_bert,hf_llama,sized_timm_vit,diffusers_unet --out "$RESULTS/compare_a.json"
  echo "rc=$? == timm's ViT's allocator history $(date +%T)"
  timeout 50 python3 -m bench.gpu_check --models sized_timm_vit --fractions 0.3 \
    --snapshots "$RESULTS/snap" --out "$RESULTS/gpu_check_vit.json"
  echo "rc=$? == the Hugging Face rows' allocator history $(date +%T)"
  timeout 40 python3 -m bench.gpu_check --models hf_bert,hf_gpt2 --fractions 0.5 \
    --snapshots "$RESULTS/snap" --out "$RESULTS/gpu_check_hf.json"
  echo "rc=$? == test_gpu $(date +%T)"
  timeout 50 python3 -m pytest -q -x -p no:cacheprovider tests/planner/test_gpu.py
  echo "rc=$? == compare, the sized models $(date +%T)"
  timeout 170 python3 -m bench.compare --eager-only --device cuda --jobs 1 \
    --models sized_qwen2,sized_llama_lora,sized_gpt2_dropout,hf_gpt2,hf_vit --out "$RESULTS/compare_b.json"
  echo "rc=$? == end $(date +%T)"
} 2>&1 | tee "$RESULTS/log.txt"
cp "$RESULTS/log.txt" "$OUT/log.txt"
tar czf "$OUT/results.tgz" -C "$RESULTS" --exclude=./snap .
tar czf "$OUT/snapshots.tgz" -C "$RESULTS" snap
ls -la "$OUT"
