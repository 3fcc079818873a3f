"""omnihvd: OmniLearn dynamic batching for Horovod (PyTorch, MPI).

Install with ``bash tools/setup.sh`` (builds horovod against your torch and MPI), or,
when horovod, torch and mpi4py are already installed, ``pip install -e .``.
"""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version():
    with open(os.path.join(HERE, "omnihvd", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


setup(
    name="omnihvd",
    version=read_version(),
    description="OmniLearn dynamic batch sizing for Horovod on heterogeneous clusters",
    long_description=open(os.path.join(HERE, "README.rst")).read(),
    long_description_content_type="text/x-rst",
    license="Apache-2.0",
    packages=find_packages(include=["omnihvd", "omnihvd.*"]),
    python_requires=">=3.8",
    # horovod is deliberately not listed: pip would try to build it without the
    # C++17 wrapper and fail against torch >= 2.1. tools/setup.sh builds it.
    install_requires=["numpy", "mpi4py>=3.1", "torch>=2.1"],
    extras_require={"plot": ["matplotlib"], "test": ["pytest", "hypothesis"]},
    entry_points={"console_scripts": ["omnihvd = omnihvd.tools.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
