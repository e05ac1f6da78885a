"""mcore-proxy: build cheap proxy MoE models from sharded Megatron checkpoints."""

__version__ = "0.2.0"
