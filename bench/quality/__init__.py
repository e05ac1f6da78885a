"""Evidence of selection fidelity (issue 13): a verifiable task family, small trained megatron-core
MoE models, and the ablation of the selection methods through the real pipeline.

    from bench.quality import task, train
    ckpt = train.trained_checkpoint("fine")        # cached; trained on CPU when missing

Run from the repository root (`python -m bench.quality.ablate`); see bench/quality/README.md.
"""
