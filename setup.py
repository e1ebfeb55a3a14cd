import re

from setuptools import find_namespace_packages, setup

# The version lives in one place, read here without importing the package (it needs torch).
VERSION = re.search(r'__version__ = "([^"]+)"', open("megatron/moe_patches/version.py", encoding="utf-8").read()).group(1)

setup(
    name="megatron-moe-patches",
    version=VERSION,
    description="MoE expert-path features for the stock megatron-core 0.16.1 wheel, for Hopper GPUs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",  # one SPDX expression; no license classifier beside it (setuptools warns)
    license_files=["LICENSE"],
    python_requires=">=3.10",
    # `megatron` is a namespace shared with megatron-core: ship only our portion.
    # megatron/moe_patches/recipes/ (no __init__.py) is found as a namespace package and
    # ships its YAML recipes as package data (`--yaml-cfg tiny-moe` finds them by name);
    # the driver's table of Megatron-LM's flags is a data file too.
    packages=find_namespace_packages(include=["megatron.moe_patches", "megatron.moe_patches.*"]),
    package_data={"megatron.moe_patches.recipes": ["*.yaml"],
                  "megatron.moe_patches.driver": ["megatron_lm_flags.jsonl", "driver_flags.jsonl"]},
    install_requires=[
        "megatron-core>=0.16.1,<0.17",
        "torch>=2.6",
        "pyyaml",
        "numpy",
        "packaging",
    ],
    extras_require={
        # F1 and F4 need TE >= 2.14; finer capability checks (fused permute+pad, op-fuser
        # ops) live in the code. PyPI's TE builds its torch extension from source.
        "te": ["transformer-engine[pytorch]>=2.14"],
        "test": ["pytest"],
        "plot": ["matplotlib"],  # benchmarks/plot.py only
        "tensorboard": ["tensorboard"],  # pretrain_gpt.py --tensorboard-dir
    },
    entry_points={
        "console_scripts": [
            "megatron-moe-patches=megatron.moe_patches.__main__:main",  # status
            "megatron-moe-pretrain=megatron.moe_patches.driver.cli:pretrain_main",  # = pretrain_gpt.py
        ]
    },
)
