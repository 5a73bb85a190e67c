"""Builds the C core (shmserve/csrc); everything else is in pyproject.toml."""
import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmserve._core",
            sources=sorted(glob.glob("shmserve/csrc/*.c")),  # the extension: every .c of csrc/
            depends=glob.glob("shmserve/csrc/*.h"),
            include_dirs=["shmserve/csrc"],
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
        )
    ]
)
