from setuptools import find_packages, setup

# torch is deliberately not pinned to a build: Ascend stacks ship their own torch (>= 2.1) and
# torch_npu; install torch first (see .ci/run) so pip does not pull a multi-GB CUDA wheel.
setup(
    name="mcore-proxy",
    version="0.2.0",
    description="Proxy MoE models for low-cost failure reproduction in Megatron/MindSpeed RL post-training",
    python_requires=">=3.10",
    packages=find_packages(include=["mcore_proxy", "mcore_proxy.*"]),
    # the activation a launch puts on PYTHONPATH (`mcore-proxy patches`; a checkout's patches/
    # links to it): package data, since mcore_proxy/activation/_patches is a folder, not a package
    package_data={"mcore_proxy.activation": ["_patches/sitecustomize.py"]},
    install_requires=["torch>=2.1", "numpy", "safetensors", "kmedoids", "tqdm"],
    extras_require={
        # trl: the fault demonstration inside GRPOTrainer; mlflow-skinny (+ sqlalchemy, alembic for
        # its SQLite store), wandb and swanlab write the logs their readers are tested on (the
        # W&B and SwanLab readers go through those packages: versions pinned to the ones read)
        "test": [
            "pytest",
            "pytest-xdist",  # tests/run.sh: one worker per core, a test folder per worker
            "megatron-core==0.16.1",
            "psutil",
            "matplotlib",
            "tensorboard",
            "ruptures",
            "scipy",
            # pinned: docs/families.md is generated against this release, and tests/test_docs.py checks it
            "transformers==5.25.0",
            "tokenizers",
            "accelerate",
            "trl==1.16.0",
            "mlflow-skinny==3.18.0",
            "sqlalchemy",
            "alembic",
            "wandb==0.31.0",
            "swanlab==0.10.3",
            # style in CI (.ci/run, pyproject.toml): pinned, so that a newer formatter cannot fail unchanged code
            "ruff==0.17.6",
        ],
        # tools/smoke_other_python.sh: the checkpoint and convert tests it runs under a second Python;
        # psutil: megatron-core's torch_dist writer needs it in its worker processes (without it the
        # worker raises and the saving ranks wait forever)
        "smoke": ["pytest", "megatron-core==0.16.1", "psutil"],
        "report": ["matplotlib"],
        # compare: TensorBoard event reader, change points (ruptures), statistics, PNG report
        "diagnose": ["tensorboard", "ruptures", "scipy", "matplotlib"],
        # accelerate: transformers dequantizes FP8 releases on CPU only through it
        "hf": ["transformers>=5", "tokenizers", "accelerate"],
        # the RL framework of examples/rl_faults_trl (faults need nothing of it)
        "rl": ["transformers>=5", "tokenizers", "accelerate", "trl>=1.16"],
        # torch_npu and mindspeed are not on the package registry in a usable form: install them
        # from the Ascend stack; mcore-proxy imports them behind guards.
        "npu": [],
    },
    entry_points={"console_scripts": ["mcore-proxy=mcore_proxy.cli:main"]},
)
