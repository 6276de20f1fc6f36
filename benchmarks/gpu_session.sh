#!/usr/bin/env bash
# The session's GPU call: build, every CUDA test, PowerSGD against torch's hook where the GPU
# sets the pace (batch 256) with a profile of each variant. Files land in $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_session.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
MAX_JOBS=16 python -m pip install -v --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
  || { grep -E "error" -A5 "$out/build.log" | head -60; exit 1; }
timeout 220 python -m pytest -q -rs -m needs_cuda tests > "$out/pytest_cuda.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest_cuda.log"
timeout 330 python benchmarks/powersgd.py --models resnet50 --ranks 1 4 8 --buckets 25 1 --batch 256 --reps 4 \
  --iters 8 --warmup 5 --trace-dir /tmp/psgd --out "$out/powersgd_b256.json" 2>&1 | grep -E "PASS|FAIL| MB "
cp /tmp/psgd/resnet50/kernels.txt "$out/powersgd_kernels.txt"
cp /tmp/psgd/resnet50/trace_commtune_PowerSGD_r4__25_MB.json.gz "$out/"
