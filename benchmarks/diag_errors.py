"""Which C++ errors reach Python on this torch, and which crash? (GPU-machine diagnosis)

    python benchmarks/diag_errors.py dtype|size|inline
"""
import faulthandler
import sys

import torch

faulthandler.enable()
which = sys.argv[1]
if which == "inline":
    from torch.utils.cpp_extension import load_inline

    src = ('void boom(at::Tensor t) { TORCH_CHECK(t.numel() == 3, "numel ", t.numel(), " shape ", '
           't.sizes(), " text ", std::string("s")); }')
    fn = lambda: load_inline("throwtest", cpp_sources=src, functions=["boom"]).boom(torch.ones(4))
else:
    from commtune import _C

    calls = {
        "dtype": lambda: _C.cast_scale(torch.ones(4, dtype=torch.int32), 1.0, torch.float16),
        "size": lambda: _C.cast_scale_(torch.ones(4), 1.0, torch.empty(3, dtype=torch.float16)),
    }
    fn = calls[which]
try:
    fn()
except RuntimeError as e:
    print(which, "raised RuntimeError:", str(e).splitlines()[0])
