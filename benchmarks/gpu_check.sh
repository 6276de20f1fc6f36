#!/usr/bin/env bash
# One GPU, one call (about 9 minutes): build, the CUDA tests, the figures the open issues ask for,
# and the NCCL tuner plugin loaded by NCCL. Writes at most 8 files to $OUT (or benchmarks/results/).
#   bash benchmarks/gpu_check.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MAX_JOBS=${MAX_JOBS:-16} python -m pip install -v --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
  || { grep -E "error" -A5 "$out/build.log" | head -60; exit 1; }
timeout 170 python -m pytest -q -rs -m needs_cuda tests 2>&1 | tee "$out/pytest_cuda.log" | grep -E "^(FAILED|ERROR)|passed|failed"
# Issue 2: hook overhead where the GPU sets the pace (counters time one iteration in ten by default).
timeout 100 python benchmarks/hook_overhead.py --batch 256 --reps 5 --iters 10 --warmup 5 \
  --out "$out/hook_overhead_b256.json" 2>&1 | grep -E "PASS|FAIL|  [0-9]+\.[0-9]+  "
# Issue 3: PowerSGD against torch's hook where the GPU sets the pace, with a profile of each variant.
timeout 280 python benchmarks/powersgd.py --models resnet50 --ranks 1 4 8 --buckets 25 1 --batch 256 --reps 3 --iters 8 \
  --warmup 5 --trace-dir /tmp/psgd --out "$out/powersgd_b256.json" 2>&1 | grep -E "PASS|FAIL| MB "
cp /tmp/psgd/resnet50/kernels.txt "$out/powersgd_kernels.txt" 2>/dev/null
cp /tmp/psgd/resnet50/trace_commtune_PowerSGD_r4__25_MB.json.gz "$out/" 2>/dev/null
# Issue 4: the tuner plugin, loaded and consulted by NCCL (look for "commtune tuner" lines).
make -C csrc/nccl_tuner > /dev/null && printf 'allreduce 0 18446744073709551615 ring simple\n' > /tmp/commtune.rules
NCCL_TUNER_PLUGIN=$PWD/csrc/nccl_tuner/libcommtune_nccl_tuner.so COMMTUNE_TUNER_RULES=/tmp/commtune.rules \
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING timeout 60 python -c "
import os, torch, torch.distributed as dist
os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT='29541')
torch.cuda.set_device(0); dist.init_process_group('nccl')
x = torch.ones(1 << 20, device='cuda'); dist.all_reduce(x); torch.cuda.synchronize()
print('allreduce ok', float(x[0])); dist.destroy_process_group()" > "$out/tuner.log" 2>&1
grep -iE "commtune tuner|tuner" "$out/tuner.log" | head -8
# Issue 4: the topology through NVML, and as nvidia-smi prints it.
python -c "import subprocess, commtune as ct; t = ct.nccl.topology(); print('topology:', t.source, '-', t.summary()); \
print('nvidia-smi:', ct.nccl.parse_topo_matrix(subprocess.run(['nvidia-smi', 'topo', '-m'], capture_output=True, text=True).stdout).summary())"
