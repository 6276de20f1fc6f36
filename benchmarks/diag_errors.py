"""Does a C++ exception from an extension reach Python on this torch? (kept for GPU-machine diagnosis)"""
import faulthandler
import sys

import torch

faulthandler.enable()
which = sys.argv[1]
if which == "inline":
    from torch.utils.cpp_extension import load_inline
    m = load_inline("throwtest", cpp_sources="void boom() { TORCH_CHECK(false, \"boom from inline\"); }",
                    functions=["boom"], verbose=False)
    fn = m.boom
else:
    from commtune import _C
    fn = lambda: _C.cast_scale(torch.ones(4, dtype=torch.int32), 1.0, torch.float16)
try:
    fn()
except RuntimeError as e:
    print(which, "raised RuntimeError:", str(e).splitlines()[0])
