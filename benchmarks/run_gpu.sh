#!/usr/bin/env bash
# On a GPU machine: build commtune there, run every test (CUDA ones included), then the benchmarks.
# Logs and result files go to $OUT (the device tool's folder) or benchmarks/results/.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
MAX_JOBS=${MAX_JOBS:-16} python -m pip install -v --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
  || { tail -50 "$out/build.log"; exit 1; }
grep '^commtune:' "$out/build.log"
python -m pytest -q -rs tests 2>&1 | tee "$out/pytest.log" | tail -15
for bench in "$@"; do
  python "benchmarks/$bench.py" --out "$out/$bench.json" 2>&1 | tee "$out/$bench.log" | tail -25
done
