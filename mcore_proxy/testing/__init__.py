"""Helpers that build and run real megatron-core models on a CPU-only torch.

Used by the tests, the examples and `verify --functional`; never by the conversion path.
"""
