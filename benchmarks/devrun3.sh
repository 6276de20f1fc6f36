export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
MAX_JOBS=16 python -m pip install -q --no-build-isolation --no-deps -e . > $OUT/build.log 2>&1 || { grep -E "error" -A5 $OUT/build.log | head -40; exit 1; }
echo "== error paths"
for call in "_C.quantize_layout(10, 0, 8, 'int8')" "_C.cast_scale_(torch.ones(4), 1.0, torch.empty(3, dtype=torch.float16))" "_C.threshold_top_k_(torch.randn(100), 101, torch.empty(202, dtype=torch.int32), torch.empty(1, dtype=torch.int64), False)"; do
  timeout 60 python -c "
import torch; from commtune import _C
try: $call
except Exception as e: print('raised', type(e).__name__, str(e)[:70])
" 2>&1 | grep -E "raised|Segmentation|Fatal" | head -2
done
timeout 120 cuda-gdb -batch -ex run -ex bt --args python -c "import torch; from commtune import _C; _C.threshold_top_k_(torch.randn(100), 101, torch.empty(202, dtype=torch.int32), torch.empty(1, dtype=torch.int64), False)" > $OUT/gdb_bt.txt 2>&1
grep -E "^#[0-9]+" $OUT/gdb_bt.txt | head -25
echo "== tests"
timeout 300 python -m pytest -q -rs -m needs_cuda tests --deselect "tests/test_top_k.py::test_bad_arguments_are_refused[cuda]" > $OUT/pytest_cuda.log 2>&1
tail -3 $OUT/pytest_cuda.log; grep -E "^(FAILED|ERROR)" $OUT/pytest_cuda.log | head -20
echo "== bench (2 ranks in flight)"
timeout 100 python benchmarks/compression.py --out $OUT/compression.json 2>&1 | head -19
echo "== bench (4 ranks in flight)"
COMMTUNE_AB_RANKS4=1 timeout 100 python benchmarks/compression.py --out $OUT/compression_ab4.json 2>&1 | grep -E "copy fp32|reduce"
