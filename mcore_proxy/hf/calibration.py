"""Calibration data: JSONL records -> token windows -> padded batches (for `collect`, `fidelity`).

A record is `{"text": "..."}` (tokenised with the checkpoint's own tokenizer),
`{"input_ids": [ids]}`, or, for a vision-language model, `{"text": "...", "image": "file.png"}`
(image-text: the image path relative to the data file, the text holding the model's image
placeholder where the image goes, e.g. Aria's `<|img|>`, with whatever the model's chat format
puts around it). Image-text records go through the model's own processor (its
`processor_config.json` / `preprocessor_config.json` in the checkpoint folder, read by
transformers' AutoProcessor without remote code): its image tokens are routed through the
language model's experts like any token, and counted. A text sequence longer than `max_length`
is cut into consecutive windows of at most that many tokens (so long documents are used whole,
not truncated); an image-text record is never cut (its image tokens belong together): one longer
than `max_length` is refused, and it is a batch of its own, counted whole against `max_tokens`.
Batches are padded on the right with an attention mask: for a causal model the real tokens then
compute exactly what they compute alone, and padding positions are excluded from every statistic
and metric.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from mcore_proxy.core.errors import ProxyError

MAX_LINE_BYTES = 64 << 20


@dataclass(frozen=True)
class Batch:
    """input_ids [B, S] int64; attention_mask [B, S] int64, 1 for real tokens; tokens: real ones.
    inputs: the further model inputs of an image-text record (B = 1), as the model's processor
    makes them (`pixel_values`, and e.g. `pixel_mask` or `image_grid_thw`)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    inputs: dict = field(default_factory=dict)

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


def token_ids(
    path: Path, tokenizer_for, vocab_size: int, processor_for=None, max_length: int | None = None
) -> Iterator[list[int] | Batch]:
    """Token ids of every text record, and a Batch of each image-text record. `tokenizer_for()`
    and `processor_for()` return the tokenizer and the processor (each called on the first record
    that needs it, so `input_ids` data needs neither)."""
    tokenizer = processor = None
    for number, record in records(Path(path)):
        where = f"{path}:{number}"
        if "image" in record:
            if processor_for is None:
                raise ProxyError(f"{where}: an image-text record, which only `collect` and `fidelity` read")
            processor = processor or processor_for()
            yield image_text_batch(where, Path(path).parent, record, processor, vocab_size, max_length)
            continue
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


def image_text_batch(where: str, folder: Path, record: dict, processor, vocab_size: int, max_length) -> Batch:
    """The processor's model inputs of one `{"text", "image"}` record, as a Batch of one row."""
    from PIL import Image

    text, image = record.get("text"), record.get("image")
    if not isinstance(text, str) or not isinstance(image, str):
        raise ProxyError(f"{where}: an image-text record needs \"text\" and \"image\" (a file path) strings")
    placeholder = getattr(processor, "image_token", None)
    if placeholder and placeholder not in text:
        raise ProxyError(
            f"{where}: the text lacks the model's image placeholder {placeholder!r}; put it where the "
            "image goes, as the model's chat format does"
        )
    file = folder / image
    try:
        with Image.open(file) as opened:
            picture = opened.convert("RGB")
    except (OSError, Image.DecompressionBombError) as err:  # missing, unreadable, not an image, too large
        reason = type(err).__name__
        raise ProxyError(f"{where}: image {file} could not be read ({reason}); give a PNG or JPEG file") from None
    try:
        inputs = dict(processor(text=[text], images=[picture], return_tensors="pt"))
    except Exception as err:  # the processor's own check of the record (placeholders vs images), whatever it raises
        raise ProxyError(f"{where}: the model's processor refuses the record ({str(err)[:160]})") from None
    ids = inputs.pop("input_ids").to(torch.int64)
    mask = inputs.pop("attention_mask", torch.ones_like(ids)).to(torch.int64)
    if int(ids.max()) >= vocab_size:
        raise ProxyError(
            f"{where}: the processor gives token id {int(ids.max())}, outside the model's vocabulary "
            f"0..{vocab_size - 1}; the processor files belong to another model"
        )
    if max_length is not None and ids.shape[1] > max_length:
        raise ProxyError(
            f"{where}: the image-text record is {ids.shape[1]} tokens, beyond --max-length {max_length}; "
            "raise --max-length (an image's tokens are never cut apart) or use a smaller image"
        )
    return Batch(ids, mask, inputs)


def windows(ids: list[int], max_length: int) -> Iterator[list[int]]:
    for start in range(0, len(ids), max_length):
        yield ids[start : start + max_length]


def batches(
    sequences: Iterator[list[int] | Batch],
    batch_size: int,
    max_length: int,
    max_tokens: int | None = None,
    pad_id: int = 0,
) -> Iterator[Batch]:
    """Right-padded batches of up to `batch_size` windows; stops after `max_tokens` real tokens
    (the last window cut short to hit it exactly). An image-text Batch passes as it is, whole."""
    if batch_size < 1 or max_length < 1:
        raise ProxyError(f"--batch-size {batch_size} and --max-length {max_length} must be at least 1")
    if max_tokens is not None and max_tokens < 1:
        raise ProxyError(f"--max-tokens {max_tokens} must be at least 1")
    pending: list[list[int]] = []
    seen = 0
    for ids in sequences:
        if isinstance(ids, Batch):
            yield ids
            seen += ids.tokens
            if max_tokens is not None and seen >= max_tokens:
                break
            continue
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


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(folder: Path):
    """The checkpoint's own processor (tokenizer and image processor), from its files only."""
    from mcore_proxy.hf.models import require_transformers

    transformers = require_transformers()
    if not any((Path(folder) / n).is_file() for n in PROCESSOR_FILES):
        raise ProxyError(
            f"{folder}: has no processor files ({' or '.join(PROCESSOR_FILES)}), so image-text "
            "records cannot be read; copy the model's processor beside the weights or give text records"
        )
    return transformers.AutoProcessor.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def data_batches(
    data: Path,
    model_dir: Path,
    vocab_size: int,
    batch_size: int,
    max_length: int,
    max_tokens: int | None = None,
    images: bool = False,
) -> Iterator[Batch]:
    """Batches of the JSONL `data` for the checkpoint in `model_dir`; `images`: image-text
    records are read (with the checkpoint's processor), else refused."""
    ids = token_ids(
        Path(data),
        lambda: load_tokenizer(model_dir),
        vocab_size,
        (lambda: load_processor(model_dir)) if images else None,
        max_length,
    )
    return batches(ids, batch_size, max_length, max_tokens)
