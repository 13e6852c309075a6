#!/usr/bin/env bash
# What limits nvidia-tma page transfers: the runs behind records/nvidia-h200-transfer-limits.md.
# Usage: packages/nvidia-tma/bench/limits.sh OUTDIR   (on a machine with the GPU; ~5 minutes).
# The probes are `kvtier bench limits PROBE` (this package adds that command to kvtier; it and
# `kvtier bench transfer` need kvtier-tools).
set -uo pipefail
out=${1:?usage: limits.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm \
    --format=csv | tee "$out/gpu.txt"
cases=mla-p1,mha-8k,mla-p64,mha-128k,flat-72k,flat-1m
for order in random sequential; do
    "$py" -m kvtier bench transfer --mib 256 --repeat 3 --cases "$cases" --order "$order" \
        --engines nvidia-tma,nvidia-register,nvidia-copy-engine --modes all,layer \
        --mixed nvidia-tma+nvidia-copy-engine --mixed nvidia-copy-engine+nvidia-tma \
        --mixed nvidia-register+nvidia-tma \
        --json "$out/order-$order.json" 2>&1 | grep -v '^transfer cases\|^mixed' | tee "$out/order-$order.txt"
done
# both directions at once against the CTAs each direction gets
"$py" -m kvtier bench transfer --mib 256 --repeat 3 --cases mla-p1,mha-8k,mla-p64,mha-128k \
    --engines nvidia-tma,nvidia-register --directions both --modes all \
    --sweep ctas=2,4,8,16 --both-sweep --json "$out/both-ctas.json" 2>&1 \
    | grep -v '^transfer cases' | tee "$out/both-ctas.txt"
"$py" -m kvtier bench limits gemm --json "$out/gemm.json" 2>&1 | tee "$out/gemm.txt"
"$py" -m kvtier bench limits pcie --json "$out/pcie.json" 2>&1 | tee "$out/pcie.txt"
"$py" -m kvtier bench limits latency --json "$out/latency.json" 2>&1 | tee "$out/latency.txt"
"$py" -m kvtier bench limits routes --json "$out/routes.json" 2>&1 | tee "$out/routes.txt"
timeout 240 "$py" -m kvtier bench limits ncu --mib 64 --json "$out/ncu.json" 2>&1 | tee "$out/ncu.txt"
