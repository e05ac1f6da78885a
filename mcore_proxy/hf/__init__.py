"""The transformers runtime (the HF checkpoint *format* is `checkpoint.hf`): loading and running HF
MoE models safely, their routers and restriction to kept experts (`models`), and calibration data
(`calibration`) for `collect` and `fidelity`."""
