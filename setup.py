"""Build of moe_ext._C with plain setuptools.

C11 sources (csrc/*.c, csrc/cpu/*.c) go through the C compiler; CUDA sources
(csrc/cuda/*.cu) through nvcc, with cudart linked statically. The module is
built against the stable ABI (abi3, Python >= 3.10) and never links libtorch:
tensors arrive through DLPack.

Environment:
  MOE_EXT_CUDA=0            build the CPU-only module even when nvcc exists
  MOE_EXT_CUDA_ARCHS="..."  GPU targets, ';'-separated (default "80;89;90a")
  MOE_EXT_BUILD_JOBS        nvcc processes at once (default: the CPU count)
  CUDA_HOME                 toolkit root (default: from nvcc on PATH, else /usr/local/cuda)
"""
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
LIMITED_API = "0x030A0000"


def find_nvcc():
    if os.environ.get("MOE_EXT_CUDA", "1") == "0":
        return None
    home = os.environ.get("CUDA_HOME")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    candidates += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    for path in candidates:
        if path and os.path.isfile(path):
            return path
    return None


def gencode_flags(archs):
    flags = []
    for arch in filter(None, (a.strip() for a in archs.split(";"))):
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


class BuildExtWithCuda(build_ext):
    """Compiles the .cu sources with nvcc and links their objects in."""

    def build_extension(self, ext):
        cuda_sources = [s for s in ext.sources if s.endswith(".cu")]
        ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
        # the link below is skipped unless something here is newer than the module: the CUDA
        # sources and every header count, not only the C sources left in ext.sources
        ext.depends = list(ext.depends) + cuda_sources + sorted(
            glob("csrc/**/*.h", recursive=True) + glob("csrc/**/*.cuh", recursive=True))
        nvcc = find_nvcc() if cuda_sources else None
        if nvcc:
            cuda_home = os.path.dirname(os.path.dirname(nvcc))
            archs = os.environ.get("MOE_EXT_CUDA_ARCHS", "80;89;90a")
            out_dir = os.path.join(self.build_temp, "cuda")
            os.makedirs(out_dir, exist_ok=True)
            commands = []
            for src in cuda_sources:
                obj = os.path.join(out_dir, os.path.basename(src) + ".o")
                commands.append([nvcc, "-c", src, "-o", obj, "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
                                 "--expt-relaxed-constexpr", "-I", os.path.join(ROOT, "csrc", "include"),
                                 *gencode_flags(archs)])
                ext.extra_objects.append(obj)
            jobs = int(os.environ.get("MOE_EXT_BUILD_JOBS", os.cpu_count() or 1))
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                for cmd in commands:
                    print(" ".join(cmd), flush=True)
                list(pool.map(subprocess.check_call, commands))
            lib_dir = os.path.join(cuda_home, "lib64")
            if not os.path.isdir(lib_dir):
                lib_dir = os.path.join(cuda_home, "targets", "x86_64-linux", "lib")
            ext.define_macros.append(("MOE_EXT_WITH_CUDA", "1"))
            ext.extra_link_args += [f"-L{lib_dir}", "-lcudart_static", "-lrt", "-ldl",
                                    "-lpthread", "-lstdc++"]
        elif cuda_sources:
            print("moe_ext: building the CPU-only module (no nvcc, or MOE_EXT_CUDA=0)", flush=True)
        super().build_extension(ext)


c_sources = sorted(glob("csrc/*.c")) + sorted(glob("csrc/cpu/*.c"))
cuda_sources = sorted(glob("csrc/cuda/*.cu"))
openmp = [] if sys.platform == "darwin" else ["-fopenmp"]

setup(
    ext_modules=[
        Extension(
            "moe_ext._C",
            sources=c_sources + cuda_sources,
            include_dirs=["csrc", "csrc/include"],
            define_macros=[("Py_LIMITED_API", LIMITED_API)],
            extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", *openmp],
            extra_link_args=[*openmp],
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtWithCuda},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
