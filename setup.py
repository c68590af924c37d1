"""Build torch_mpmd: setuptools hands the extensions to one CMake build.

    pip install --no-build-isolation -e .

`--no-build-isolation` matters: an isolated build would install a second,
unpinned torch (DESIGN.md section 4). The CMake build tree lives in
build/cmake so scripts/test.sh can run ctest on the same objects.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """One CMake configure+build makes every extension (_C and _runtime) in the
    package directory; setuptools then copies each declared one in place."""

    _built = False

    def build_extension(self, ext: Extension) -> None:
        import torch.utils.cpp_extension

        if CMakeBuild._built:
            return
        CMakeBuild._built = True
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = ROOT / "build" / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        build_tests = os.environ.get("MPMD_BUILD_TESTS", "ON")
        configure = [
            "cmake",
            str(ROOT),
            "-G",
            "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('MPMD_BUILD_TYPE', 'Release')}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DTORCH_INCLUDE_DIR={torch.utils.cpp_extension.include_paths()[0]}",
            f"-DMPMD_OUTPUT_DIR={out_dir}",
            f"-DMPMD_BUILD_TESTS={build_tests}",
        ]
        subprocess.run(configure, cwd=build_dir, check=True)
        jobs = os.environ.get("MPMD_BUILD_JOBS", str(os.cpu_count() or 2))
        # MPMD_BUILD_TARGETS (space-separated CMake targets) builds only those:
        # scripts/test.sh builds the Python modules first and the C++ suite
        # beside pytest. Unset: every target.
        targets = os.environ.get("MPMD_BUILD_TARGETS", "").split()
        subprocess.run(["cmake", "--build", ".", "-j", jobs, *(["--target", *targets] if targets else [])],
                       cwd=build_dir, check=True)


setup(
    name="torch_mpmd",
    version="0.1.0",
    description="MPMD pipeline parallelism for PyTorch with a C++ core",
    packages=find_packages(include=["torch_mpmd", "torch_mpmd.*"]),
    package_data={"torch_mpmd": ["_C.pyi", "py.typed"]},
    ext_modules=[CMakeExtension("torch_mpmd._C"), CMakeExtension("torch_mpmd._runtime")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch==2.13.0"],
    entry_points={"torch_dynamo_backends": ["mpmd = torch_mpmd.compile.backend:mpmd_backend"]},
)
