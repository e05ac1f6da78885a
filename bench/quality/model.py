"""The two trained shapes, and building / loading / running them in megatron-core on CPU.

Everything runs in a one-rank gloo world (`mcore_proxy.functional.cpu`): the local
(non-Transformer-Engine) layer spec, SequentialMLP experts, RMSNorm, SwiGLU, RoPE, fp32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from bench.quality import task
from mcore_proxy.functional.family import family_from_args
from mcore_proxy.functional.model import Layout, ToyMoE
from mcore_proxy.functional.run import causal_inputs

# The testing ToyMoE config gates its experts with GELU although its args say --swiglu; these
# models use SiLU, as Megatron does for --swiglu, so the saved args describe them truly.
# coarse: few large experts, top-2 of 16 (Mixtral-like); fine: many small experts, top-8 of
# 64 with a shared expert (DeepSeek/Qwen3-MoE-like). Equal hidden size and depth.
SHAPES = {
    "coarse": ToyMoE(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=256,
        num_experts=16,
        moe_ffn_hidden_size=128,
        topk=2,
        vocab_size=task.VOCAB_SIZE,
        seq_length=task.SEQ_LENGTH,
    ),
    "fine": ToyMoE(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=256,
        num_experts=64,
        moe_ffn_hidden_size=32,
        topk=8,
        shared_expert_size=64,
        vocab_size=task.VOCAB_SIZE,
        seq_length=task.SEQ_LENGTH,
    ),
}
LAYOUT = Layout()  # TP = PP = EP = 1


def config(model: ToyMoE, aux_loss: float | None = None):
    """The model's TransformerConfig as Megatron builds it from the saved args (`--swiglu`:
    SiLU-gated experts); with `aux_loss`, Switch-style load balancing on (training only)."""
    import torch.nn.functional as F

    cfg = dataclasses.replace(model.transformer_config(LAYOUT), activation_func=F.silu)
    if aux_loss is None:
        return cfg
    return dataclasses.replace(cfg, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=aux_loss)


def build(model: ToyMoE, cfg=None):
    """This rank's GPTModel of `model` (call inside an initialised one-rank world), in eval mode."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = cfg or config(model)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(
        cfg,
        spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=True,
        post_process=True,
        parallel_output=False,
        position_embedding_type="rope",
    ).eval()


def logits(gpt, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s, V] logits of a causal forward pass over tokens [b, s]; padding_mask [b, s] True at
    padding (megatron-core's convention; the trace leaves those tokens out)."""
    positions, mask = causal_inputs(*tokens.shape)
    kwargs = {} if padding_mask is None else {"padding_mask": padding_mask}
    return gpt(tokens, positions, mask, **kwargs)


def read_state(ckpt: str | Path) -> dict:
    """The `model_optim_rng.pt` dict of a one-rank legacy checkpoint (ours: written by
    `train.py` or by `mcore-proxy convert`)."""
    root = Path(ckpt)
    from mcore_proxy.checkpoint.iteration import resolve_iteration_dir

    it_dir, _ = resolve_iteration_dir(root, lambda folder: False, "no tracker; pass a checkpoint train.py wrote")
    return torch.load(it_dir / "mp_rank_00" / "model_optim_rng.pt", map_location="cpu", weights_only=False)


def load(ckpt: str | Path):
    """(ToyMoE, GPTModel in eval mode) of a one-rank legacy checkpoint, loaded strictly."""
    state = read_state(ckpt)
    model = family_from_args(state["args"], seq_length=state["args"].seq_length)
    gpt = build(model)
    gpt.load_state_dict(state["model"], strict=True)
    return model, gpt.eval()


def save(gpt, model: ToyMoE, ckpt: str | Path, iteration: int) -> Path:
    """A legacy checkpoint as Megatron training writes it (args, model; no optimizer)."""
    from mcore_proxy.checkpoint.iteration import TRACKER, folder_name
    from mcore_proxy.checkpoint.layout import rank_dir_name

    root = Path(ckpt)
    folder = root / folder_name(iteration) / rank_dir_name(0, 0, 0, LAYOUT)
    folder.mkdir(parents=True, exist_ok=True)
    args = model.megatron_args(LAYOUT)
    args.iteration = iteration
    torch.save(
        {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": gpt.state_dict_for_save_checkpoint(),
        },
        folder / "model_optim_rng.pt",
    )
    (root / TRACKER).write_text(str(iteration))
    return root


@torch.no_grad()
def generate(gpt, problems: list[task.Problem], batch: int = 500) -> list[str]:
    """Greedy answers (the characters after "=", up to and including the first ".")."""
    out = []
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        tokens, lengths = task.prompts(chunk)
        # causal model: columns past the longest prompt plus the answer are never read
        tokens = tokens[:, : min(task.SEQ_LENGTH, int(lengths.max()) + task.MAX_ANSWER)]
        rows = torch.arange(len(chunk))
        answers = [[] for _ in chunk]
        done = torch.zeros(len(chunk), dtype=torch.bool)
        for _ in range(task.MAX_ANSWER):
            nxt = logits(gpt, tokens)[rows, lengths - 1].argmax(-1)
            for i in (~done).nonzero().flatten().tolist():
                answers[i].append(int(nxt[i]))
            done |= nxt == task.VOCAB["."]
            tokens[rows, lengths.clamp(max=tokens.shape[1] - 1)] = nxt
            lengths = (lengths + 1).clamp(max=tokens.shape[1])
            if done.all():
                break
        out.extend(task.decode(a) for a in answers)
    return out


def accuracy(gpt, problems: list[task.Problem]) -> float:
    """Exact-match share: the generated answer equals `answer + "."`."""
    answers = generate(gpt, problems)
    return sum(a == p.answer + "." for a, p in zip(answers, problems)) / len(problems)
