"""Megatron knowledge, shared by every checkpoint format and command.

- `megatron_args`: the saved training arguments (read without unpickling code);
- `layer_pattern`, `pipeline_layout`: which layers are MoE, dense or absent, on which stage;
- `launch_flags`: the launch flags of a proxy run;
- `sharding`: the one declarative table of how each tensor is split over TP, EP and PP;
- `spec`: the model spec (shapes and counts) read from a checkpoint.
"""
