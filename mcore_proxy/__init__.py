"""mcore-proxy: build cheap proxy MoE models from sharded Megatron checkpoints."""

__version__ = "0.1.0"
