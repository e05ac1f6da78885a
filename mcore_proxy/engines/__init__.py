"""The engines a proxy runs in, seen from outside: where their MoE routers, experts and logits are,
and the one owner of the hooks put on them. Light enough to import inside training and rollout
processes; each module imports its engine only when asked about one of its models.

- `engines.hooks`: `Hooks`, the owner of every hook handle, and `CallbackHandle`;
- `engines.megatron`: megatron-core models (the trainer): MoE layers, routers, output layers, layer ids;
- `engines.transformers`: transformers models: decoder layers, routers, fused experts;
- `engines.vllm`: models vLLM built (the rollout engine).
"""
