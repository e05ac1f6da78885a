"""The engines a proxy runs in, seen from outside: where their MoE routers and logits are, and
hooks on them that can be removed. Light enough to import inside training and rollout processes;
each module imports its engine only when asked about one of its models.

- `engines.vllm`: models vLLM built (the rollout engine).
"""
