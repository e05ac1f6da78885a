"""bench/quality's word problems for Hugging Face models: a character tokenizer built locally, the
tiny Qwen3-MoE shape of the original, the prompt dataset and the verifiable reward.

The token ids are bench/quality's (`task.VOCAB`: 0 is padding, 1.. the characters), so a problem
line is the same id sequence here as in the Megatron demonstration. The full stop ends an answer
and is the tokenizer's (and generation's) end-of-sequence token; `[UNK]` takes the id after the
characters. Nothing here is downloaded: the tokenizer is a `tokenizers` WordLevel model over the
characters, saved with the model by `save_pretrained`.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench.quality lives in the repository, not in the package
    sys.path.insert(0, str(REPO))

from bench.quality import task  # noqa: E402

EOS = "."
UNK = "[UNK]"
PAD = "[PAD]"

# The original: 4 layers, top-2 of 16 experts (bench/quality's `coarse` shape, as Qwen3-MoE).
SHAPE = dict(
    vocab_size=task.VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=task.SEQ_LENGTH,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    router_aux_loss_coef=0.01,
)


def tokenizer():
    """A `PreTrainedTokenizerFast`: one token per character, ids as bench/quality's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: task.PAD, **task.VOCAB, UNK: len(task.VOCAB) + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=EOS,
        padding_side="left",
        model_max_length=task.SEQ_LENGTH,
    )


def config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **{**SHAPE, **overrides}, pad_token_id=task.PAD, eos_token_id=task.VOCAB[EOS], bos_token_id=None
    )


def build(seed: int = 0, **overrides):
    """An untrained original (`overrides` change the shape, e.g. for a smoke test)."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config(**overrides))


def prompt(problem) -> str:
    return problem.prompt + "="


def rl_problems(size: int) -> list:
    """The RL training set: the first `size` training-split problems whose prompt leaves room for
    the longest answer within the sequence length."""
    fit = [p for p in task.split("train") if len(prompt(p)) + task.MAX_ANSWER <= task.SEQ_LENGTH]
    return fit[:size]


def dataset(problems):
    """A `datasets.Dataset` of plain-text prompts ("prompt" column) with their answers."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": prompt(p), "answer": p.answer} for p in problems])


def answer_text(ids) -> str:
    """The characters of generated ids, up to and including the first full stop."""
    text = task.decode(ids)
    return text[: text.index(EOS) + 1] if EOS in text else text


def exact_match_reward(completions, answer, completion_ids=None, **_) -> list[float]:
    """The verifiable reward: 1 when the answer is exactly `answer` + ".", else 0. Reads the token
    ids (the full stop is the end-of-sequence token, which decoded text leaves out)."""
    texts = (
        [answer_text(ids) for ids in completion_ids]
        if completion_ids is not None
        else [c if c.endswith(EOS) else c + EOS for c in completions]
    )
    return [float(t == a + EOS) for t, a in zip(texts, answer)]
