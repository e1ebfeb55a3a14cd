from setuptools import find_namespace_packages, setup

setup(
    name="megatron-moe-patches",
    version="0.1.0",
    description="MoE expert-path features for the stock megatron-core 0.16.1 wheel, for Hopper GPUs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # `megatron` is a namespace shared with megatron-core: ship only our portion.
    packages=find_namespace_packages(include=["megatron.moe_patches", "megatron.moe_patches.*"]),
    install_requires=[
        "megatron-core>=0.16.1,<0.17",
        "torch>=2.6",
        "pyyaml",
        "numpy",
        "packaging",
    ],
    extras_require={
        # Finer capability checks (fused permute+pad, op-fuser ops) live in the code.
        "te": ["transformer-engine[pytorch]>=2.12"],
        "test": ["pytest"],
    },
    entry_points={"console_scripts": ["megatron-moe-patches=megatron.moe_patches.__main__:main"]},
)
