"""megatron-core models on a CPU-only torch, shipped on purpose: what `verify --functional` runs.

  cpu    the few CUDA calls megatron-core 0.16.1 makes, neutralised (the only place that patches
         megatron-core), and gloo process groups with megatron's parallel state
  model  `ToyMoE`, a small MoE GPT (GQA or multi-latent attention, MTP, learned or rope
         positions) described by Megatron args (`megatron_args`); `build_gpt`
  run    fixed tokens -> logits, `restrict_routers` (the reference a correct proxy reproduces
         exactly), `load_and_run` a legacy checkpoint in spawned ranks
  family a ToyMoE from a view's ModelSpec (`family_from_spec`; `family_from_args` for bare
         args), built and run over pipeline stages; `load_legacy_and_run` is what `verify --functional` runs

Meant for small models (tests, the quickstart, `verify --functional`), not a 600B checkpoint.
The test helpers (`mcore_proxy.testing`) build their fixtures on it; nothing here imports them.
"""
