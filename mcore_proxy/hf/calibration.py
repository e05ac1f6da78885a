"""Calibration data: JSONL records -> token windows -> padded batches (for `collect`, `fidelity`).

A record is `{"text": "..."}` (tokenised with the checkpoint's own tokenizer) or
`{"input_ids": [ids]}`. A sequence longer than `max_length` is cut into consecutive windows of
at most that many tokens (so long documents are used whole, not truncated). Batches are padded
on the right with an attention mask: for a causal model the real tokens then compute exactly what
they compute alone, and padding positions are excluded from every statistic and metric.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from mcore_proxy.core.errors import ProxyError

MAX_LINE_BYTES = 64 << 20


@dataclass(frozen=True)
class Batch:
    """input_ids [B, S] int64; attention_mask [B, S] int64, 1 for real tokens; tokens: real ones."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def padding(self) -> torch.Tensor:
        """[B * S] bool, True for padding (megatron-core's `padding_mask` convention), in the
        row-major order in which MoE blocks flatten [B, S, H] to [T, H]."""
        return self.attention_mask.reshape(-1) == 0


def records(path: Path) -> Iterator[tuple[int, dict]]:
    if not path.is_file():
        raise ProxyError(
            f"{path}: data file not found; pass a JSONL file with one {{\"text\": ...}} or "
            "{\"input_ids\": [...]} object per line"
        )
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            if len(raw) > MAX_LINE_BYTES:
                raise ProxyError(
                    f"{path}:{number}: line of {len(raw)} bytes is beyond {MAX_LINE_BYTES}; split the record"
                )
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError) as err:  # ValueError: also a number past 4300 digits
                raise ProxyError(
                    f"{path}:{number}: not a JSON object ({str(err)[:60]}); each line must be "
                    "{\"text\": ...} or {\"input_ids\": [...]}"
                ) from None
            if not isinstance(record, dict):
                raise ProxyError(
                    f"{path}:{number}: not a JSON object; each line must be {{\"text\": ...}} or "
                    "{\"input_ids\": [...]}"
                )
            yield number, record


def token_ids(path: Path, tokenizer_for, vocab_size: int) -> Iterator[list[int]]:
    """Token ids of every record. `tokenizer_for()` returns the tokenizer (called on the first
    text record only, so `input_ids` data needs none)."""
    tokenizer = None
    for number, record in records(Path(path)):
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ProxyError(f"{path}:{number}: input_ids must be a list of integers")
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise ProxyError(
                    f"{path}:{number}: token id {bad[0]} is outside the model's vocabulary "
                    f"0..{vocab_size - 1}; the data was tokenised for another model"
                )
        elif isinstance(record.get("text"), str):
            tokenizer = tokenizer or tokenizer_for()
            ids = list(tokenizer(record["text"], add_special_tokens=True)["input_ids"])
        else:
            raise ProxyError(f"{path}:{number}: needs a \"text\" string or an \"input_ids\" list")
        if ids:
            yield ids


def windows(ids: list[int], max_length: int) -> Iterator[list[int]]:
    for start in range(0, len(ids), max_length):
        yield ids[start : start + max_length]


def batches(
    sequences: Iterator[list[int]], batch_size: int, max_length: int, max_tokens: int | None = None, pad_id: int = 0
) -> Iterator[Batch]:
    """Right-padded batches of up to `batch_size` windows; stops after `max_tokens` real tokens
    (the last window cut short to hit it exactly)."""
    if batch_size < 1 or max_length < 1:
        raise ProxyError(f"--batch-size {batch_size} and --max-length {max_length} must be at least 1")
    if max_tokens is not None and max_tokens < 1:
        raise ProxyError(f"--max-tokens {max_tokens} must be at least 1")
    pending: list[list[int]] = []
    seen = 0
    for ids in sequences:
        for window in windows(ids, max_length):
            if max_tokens is not None:
                window = window[: max_tokens - seen]
            pending.append(window)
            seen += len(window)
            if len(pending) == batch_size:
                yield _pad(pending, pad_id)
                pending = []
            if max_tokens is not None and seen >= max_tokens:
                break
        if max_tokens is not None and seen >= max_tokens:
            break
    if pending:
        yield _pad(pending, pad_id)


def _pad(rows: list[list[int]], pad_id: int) -> Batch:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        mask[i, : len(row)] = 1
    return Batch(ids, mask)


def load_tokenizer(folder: Path):
    """The checkpoint's own tokenizer, from its files only (no remote code)."""
    from mcore_proxy.hf.models import require_transformers

    transformers = require_transformers()
    if not any((Path(folder) / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ProxyError(
            f"{folder}: has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json), so "
            "{\"text\"} records cannot be tokenised; copy the tokenizer beside the weights or give "
            "{\"input_ids\": [...]} records"
        )
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def data_batches(
    data: Path, model_dir: Path, vocab_size: int, batch_size: int, max_length: int, max_tokens: int | None = None
) -> Iterator[Batch]:
    """Batches of the JSONL `data` for the checkpoint in `model_dir`."""
    return batches(
        token_ids(Path(data), lambda: load_tokenizer(model_dir), vocab_size), batch_size, max_length, max_tokens
    )
