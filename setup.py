"""Builds one extension, commtune._C, against the torch that is installed.

COMMTUNE_CUDA=auto|0|1   auto: CUDA when torch has CUDA and nvcc is found.
TORCH_CUDA_ARCH_LIST     respected; defaults to 9.0 (sm_90, Hopper).
MAX_JOBS                 respected by torch's ninja build.
"""
import glob
import os
import shutil

import torch
from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc", "commtune")


def settle_cuda_home():
    # Without CUDA_HOME, torch takes the folder above `nvcc`. Where nvcc is a wrapper script
    # (/usr/local/bin/nvcc on our CPU machines) that folder holds no CUDA and the link fails
    # on -lcudart; take /usr/local/cuda then, as torch does when it finds no nvcc at all.
    if torch.version.cuda is None or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None or os.path.exists(os.path.join(os.path.dirname(nvcc), "..", "include", "cuda_runtime.h")):
        return
    if os.path.exists("/usr/local/cuda/include/cuda_runtime.h"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
        print(f"commtune: CUDA_HOME=/usr/local/cuda (nothing of CUDA beside {nvcc})")


settle_cuda_home()
from torch.utils import cpp_extension  # noqa: E402 - reads CUDA_HOME once, at import


def math_library_headers():
    """Flags that find cuSPARSE's, cuBLAS's and cuSOLVER's headers (which torch's CUDA headers
    include) in torch's own nvidia-* wheels when the CUDA toolkit has only the compiler.
    After the toolkit's own folders (-idirafter), so that they never shadow its runtime headers."""
    if os.path.exists(os.path.join(cpp_extension.CUDA_HOME or "", "include", "cusparse.h")):
        return [], []
    site_packages = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site_packages, "nvidia", "**", "include", "cusparse.h"), recursive=True))
    if not found:
        return [], []
    folder = os.path.dirname(found[0])
    print(f"commtune: cusparse.h etc. from {folder} (the CUDA toolkit has none)")
    return ["-idirafter", folder], [f"-Xcompiler=-idirafter,{folder}"]


def want_cuda():
    choice = os.environ.get("COMMTUNE_CUDA", "auto").lower()
    if choice not in ("auto", "0", "1"):
        raise SystemExit(f"COMMTUNE_CUDA must be auto, 0 or 1, not {choice!r}")
    have = torch.version.cuda is not None and (
        cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    )
    if choice == "1" and not have:
        raise SystemExit("COMMTUNE_CUDA=1 but torch has no CUDA or nvcc was not found")
    return have if choice == "auto" else choice == "1"


def write_build_info(with_cuda):
    # Read at import: loading the extension under another torch must fail clearly, not crash.
    path = os.path.join(ROOT, "python", "commtune", "_build_info.py")
    with open(path, "w") as f:
        f.write(f"TORCH_VERSION = {torch.__version__!r}\nWITH_CUDA = {with_cuda!r}\n")


def extension():
    with_cuda = want_cuda()
    sources = sorted(glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True))
    # The C++ standard is the one torch asks for (C++20 from torch 2.13 on). Hidden visibility,
    # as pybind11 asks of modules: our classes then match its hidden ones (22 warnings otherwise),
    # and nothing but PyInit__C is exported.
    cxx = ["-O3", "-fvisibility=hidden"]
    nvcc = ["-O3", "--use_fast_math", "-lineinfo"]
    macros = []
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        sources += sorted(glob.glob(os.path.join(CSRC, "**", "*.cu"), recursive=True))
        macros.append(("COMMTUNE_WITH_CUDA", None))
        cxx_headers, nvcc_headers = math_library_headers()
        cxx += cxx_headers
        nvcc += nvcc_headers
        ext_cls = cpp_extension.CUDAExtension
    else:
        ext_cls = cpp_extension.CppExtension
    print(f"commtune: torch {torch.__version__}")
    print(f"commtune: CUDA {'on' if with_cuda else 'off'} (COMMTUNE_CUDA={os.environ.get('COMMTUNE_CUDA', 'auto')})")
    if with_cuda:
        print(f"commtune: TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    print(f"commtune: MAX_JOBS={os.environ.get('MAX_JOBS', 'default')}")
    print(f"commtune: cxx flags {' '.join(cxx)}")
    if with_cuda:
        print(f"commtune: nvcc flags {' '.join(nvcc)}")
    write_build_info(with_cuda)
    return ext_cls(
        name="commtune._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
    )


setup(
    name="commtune",
    version="0.1.0",
    description="C++/CUDA DDP communication hooks, NCCL tuning and counters for PyTorch",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.10",
    install_requires=["torch"],
)
