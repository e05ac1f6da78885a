from setuptools import find_packages, setup

# torch is deliberately not pinned to a build: Ascend stacks ship their own torch (>= 2.1) and
# torch_npu; install torch first (see .ci/run) so pip does not pull a multi-GB CUDA wheel.
setup(
    name="mcore-proxy",
    version="0.1.0",
    description="Proxy MoE models for low-cost failure reproduction in Megatron/MindSpeed RL post-training",
    python_requires=">=3.10",
    packages=find_packages(include=["mcore_proxy", "mcore_proxy.*"]),
    install_requires=["torch>=2.1", "numpy", "safetensors", "kmedoids", "tqdm"],
    extras_require={
        "test": ["pytest", "megatron-core==0.16.1", "psutil", "matplotlib",
                 "tensorboard", "ruptures", "scipy", "transformers>=5", "tokenizers", "accelerate"],
        "report": ["matplotlib"],
        # compare: TensorBoard event reader, change points (ruptures), statistics, PNG report
        "diagnose": ["tensorboard", "ruptures", "scipy", "matplotlib"],
        # accelerate: transformers dequantizes FP8 releases on CPU only through it
        "hf": ["transformers>=5", "tokenizers", "accelerate"],
        # torch_npu and mindspeed are not on the package registry in a usable form: install them
        # from the Ascend stack; mcore-proxy imports them behind guards.
        "npu": [],
    },
    entry_points={"console_scripts": ["mcore-proxy=mcore_proxy.cli:main"]},
)
