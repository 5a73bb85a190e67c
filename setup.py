"""Builds the C core (shmserve/csrc); everything else is in pyproject.toml."""
import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmserve._core",
            sources=["shmserve/csrc/core.c", "shmserve/csrc/mapping.c", "shmserve/csrc/slots.c",
                     "shmserve/csrc/stats.c"],
            depends=glob.glob("shmserve/csrc/*.h"),
            include_dirs=["shmserve/csrc"],
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
        )
    ]
)
