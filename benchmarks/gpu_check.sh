#!/usr/bin/env bash
# One GPU: the CUDA tests and the figures the open issues ask for, in stages that each fit one
# device call (under 10 minutes; the build, about a minute, runs when commtune._C is missing).
# Run them back to back so the machine stays warm:
#   bash benchmarks/gpu_check.sh tests      # build, CUDA tests, hook overhead (5 x 50), compression kernels
#   bash benchmarks/gpu_check.sh powersgd   # PowerSGD vs torch: ResNet-50 batch 256 and the encoder
#   bash benchmarks/gpu_check.sh study      # scaling study's 1-GPU rows, optimizer overlap
#   bash benchmarks/gpu_check.sh compression  # build, CUDA tests, compression kernels (no hook overhead)
#   bash benchmarks/gpu_check.sh profile    # Nsight Compute on the compression kernels below the bar
# Writes at most 8 files per stage to $OUT (or benchmarks/results/).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
stage=${1:?usage: gpu_check.sh tests|powersgd|study|compression|profile}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if ! python -c "import commtune._C" 2>/dev/null; then
  MAX_JOBS=${MAX_JOBS:-16} python -m pip install -v --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
    || { grep -E "error" -A5 "$out/build.log" | head -60; exit 1; }
fi
case "$stage" in
  tests)
    timeout 240 python -m pytest -q -rs -m needs_cuda tests > "$out/pytest_cuda.log" 2>&1
    tail -3 "$out/pytest_cuda.log"; grep -E "^(FAILED|ERROR)" "$out/pytest_cuda.log" | head -20
    # Issue 2's bars: >= 5 interleaved repetitions of >= 50 iterations, where the GPU sets the pace.
    timeout 300 python benchmarks/hook_overhead.py --batch 256 --reps 5 --iters 50 --warmup 10 \
      --out "$out/hook_overhead_b256.json" 2>&1 | grep -E "PASS|FAIL|  [0-9]+\.[0-9]+  "
    # Issue 5's bar: every compression pass at >= 80% of the device copy's bandwidth.
    timeout 90 python benchmarks/compression.py --out "$out/compression.json" 2>&1 | tail -22
    ;;
  compression)
    timeout 330 python -m pytest -q -rs -m needs_cuda tests > "$out/pytest_cuda.log" 2>&1
    tail -3 "$out/pytest_cuda.log"; grep -E "^(FAILED|ERROR)" "$out/pytest_cuda.log" | head -20
    timeout 120 python benchmarks/compression.py --out "$out/compression.json" 2>&1 | tail -26
    ;;
  powersgd)
    timeout 300 python benchmarks/powersgd.py --models resnet50 --batch 256 --reps 3 --iters 8 --warmup 5 \
      --out "$out/powersgd_b256.json" 2>&1 | grep -E "PASS|FAIL| MB |Error"
    timeout 260 python benchmarks/powersgd.py --models encoder --reps 3 --iters 8 --warmup 5 \
      --out "$out/powersgd_encoder.json" 2>&1 | grep -E "PASS|FAIL| MB |Error"
    ;;
  study)
    timeout 320 python benchmarks/resnet50_scaling.py --ranks 1 --predict-ranks 8 --iters 12 --warmup 6 \
      --out "$out/resnet50_scaling_1gpu.json" 2>&1 | tail -25
    timeout 200 python benchmarks/overlap.py --reps 4 --iters 15 --out "$out/overlap.json" 2>&1 | tail -12
    ;;
  profile)
    # What bounds the passes under 80% of copy bandwidth: every launch of their kernels in one
    # timing of each pass (4 launches, 3 of them warm-up), with the sections that say whether
    # memory, issue or latency sets the pace.
    if ! command -v ncu > /dev/null; then echo "ncu (Nsight Compute) is not installed here"; exit 1; fi
    timeout 400 ncu --clock-control none \
      --kernel-name "regex:(^|[^e])quantize_warp_kernel|reduce_warp_kernel|sign_decode_(mean|table)_kernel|sample_threshold_kernel|streaming_kernel|place_kernel" \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis \
      python benchmarks/compression.py --iters 1 --no-idle --out "$out/compression_profiled.json" > "$out/ncu_compression.txt" 2>&1
    grep -E "^  [A-Za-z_].*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issued Warp" \
      "$out/ncu_compression.txt" | head -80
    ;;
  *)
    echo "unknown stage: $stage (tests, powersgd, study, compression or profile)"; exit 2
    ;;
esac
