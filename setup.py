"""Packaging hook: a wheel built with GENSCORE_WHEEL_KERNELS=DIR carries genscore's CPU kernels built ahead for every
x86-64 instruction set (`make wheel`), so a server installed from it starts without compiling; pyproject.toml says
the rest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

KERNELS_ENV = "GENSCORE_WHEEL_KERNELS"  # the cache directory to build the kernels in (builds already there are reused)
SOURCE_TREE = Path(__file__).resolve().parent

# Run from the source tree, with the torch the wheel is built against: `genscore build-kernels` into argv[1], then
# the path of each target's build, one a line.
BUILD_KERNELS = """
import sys
from pathlib import Path

from app.cli import main
from models.attention_cpu import ahead_targets, built_library

if main(["build-kernels", "--cache-dir", sys.argv[1]]) != 0:
    sys.exit("genscore build-kernels failed: the wheel would carry no kernels (see above)")
for target in ahead_targets():
    print(built_library(target, Path(sys.argv[1])))
"""


def _kernel_cache() -> str | None:
    return os.environ.get(KERNELS_ENV) or None


class BuildPyWithKernels(build_py):
    """Copies the kernels' builds into the wheel's models/kernels, where models/attention_cpu.py looks first."""

    def run(self) -> None:
        super().run()
        cache_dir = _kernel_cache()
        if cache_dir is None:
            return
        built = subprocess.run([sys.executable, "-c", BUILD_KERNELS, cache_dir], cwd=SOURCE_TREE, check=True,
                               stdout=subprocess.PIPE, text=True).stdout.split()
        shipped = Path(self.build_lib) / "models" / "kernels"
        shipped.mkdir(parents=True, exist_ok=True)
        for library in map(Path, built):
            shutil.copy2(library, shipped / library.name)


class KernelsDistribution(Distribution):
    """Counts the kernels as binaries: the package then goes into platlib, and its wheel names a platform."""

    def has_ext_modules(self) -> bool:
        return _kernel_cache() is not None or super().has_ext_modules()


class PlatformWheel(bdist_wheel):
    """A wheel that carries kernels is for one platform (py3-none-linux_x86_64, say); without them it stays pure."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, platform = super().get_tag()
        # The builds link torch's C++ libraries, not Python's: any Python 3 that runs this torch can load them.
        return (python, abi, platform) if self.root_is_pure else ("py3", "none", platform)


setup(distclass=KernelsDistribution, cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
