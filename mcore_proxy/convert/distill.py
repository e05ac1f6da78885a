"""A short distillation of a proxy against its original (issue 24 item 3): opt-in, and it changes weights.

The proxy's every parameter is trained with Adam on KL(original || proxy) of the next-token
distribution at the non-padding positions of calibration token rows, both models built by
megatron-core on CPU in a one-rank gloo world (the local layer spec of `functional.family`). The
result is a new legacy checkpoint at the proxy's one-rank layout, with the proxy's args, and
`distill.json` beside it saying what was done. It is no longer a bit-for-bit proxy: `verify` against
the source fails by design, and a fault that lives in the kept experts' exact bits (a precision
fault in one expert, say) may not reproduce on it; a fault of the training loop or of routing
still does. Measured in bench/RESULTS.md (issue 24).

What it needs: both checkpoints legacy with one rank (TP = PP = EP = 1: `mcore-proxy convert
--target-tp 1 --target-pp 1 --target-ep 1` writes that), models megatron-core builds on CPU
(small ones), no MTP layers (their loss is not distilled), and token rows `[N, S]` in a `.npy` file.
For a real model the same loop runs under Megatron's own training script with the original as a
frozen teacher; this command is for the sizes a CPU holds.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mcore_proxy.core.errors import CheckpointError, ProxyError

DISTILL_FILE = "distill.json"


@dataclass(frozen=True)
class DistillSettings:
    """steps of `batch` token rows each, Adam at `lr`; `pad_id`: positions holding it are left out;
    the last `held_out` rows (default: a tenth, at least one) only measure KL before and after."""

    steps: int = 300
    lr: float = 1e-3
    batch: int = 64
    pad_id: int | None = None
    held_out: int | None = None
    seed: int = 0


@dataclass
class DistillResult:
    out: Path
    rows: int  # token rows trained on
    held_out: int
    kl_before: float  # nats per position, held-out rows
    kl_after: float
    history: list[float] = field(default_factory=list)  # training KL every 10 steps
    seconds: float = 0.0


def read_tokens(path: str | Path) -> np.ndarray:
    """Token ids [N, S] (integers, N >= 2) from a `.npy` file, read without unpickling."""
    try:
        tokens = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ProxyError(f"{path}: token file not found; pass a .npy file of token ids [rows, sequence]") from None
    except ValueError as err:
        raise ProxyError(f"{path}: not a plain .npy array of token ids ({err}); save one with numpy.save") from None
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or tokens.shape[0] < 2:
        raise ProxyError(
            f"{path}: holds a {tokens.dtype} array of shape {list(tokens.shape)}; "
            "expected integer token ids [rows >= 2, sequence]"
        )
    return tokens


def _one_rank(view, label: str):
    layout = view.info.layout
    if view.info.format != "legacy" or layout is None or (layout.tp, layout.pp, layout.ep) != (1, 1, 1):
        raise CheckpointError(
            f"{view.info.path}: distill runs {label} on one CPU rank, from a legacy checkpoint with TP = PP = EP = "
            "1; convert it with --format legacy --target-tp 1 --target-pp 1 --target-ep 1 first"
        )
    if view.spec.mtp_layers:
        raise CheckpointError(f"{view.info.path}: {label} has MTP layers, whose loss distill does not train")
    return view


def _family(view):
    from mcore_proxy.functional.family import family_from_spec

    return family_from_spec(view.spec, tied=view.embeddings_tied())


def _build(view):
    """The one-rank model chunk of `view`, its tensors loaded strictly, in fp32 (call inside the world)."""
    import torch

    from mcore_proxy.checkpoint.formats import get_format
    from mcore_proxy.functional.family import build_chunks
    from mcore_proxy.functional.model import Layout

    (chunk,) = build_chunks(_family(view), Layout())
    state = get_format("legacy").load_rank(view.info.path, (0, 0, 0), Layout())
    chunk.load_state_dict(state["model"], strict=True)
    return chunk.to(torch.float32)


def _forward(chunk, tokens):
    """Logits [b, s, V] of a causal pass over tokens [b, s] (with gradients, unlike `run.forward_logits`)."""
    from mcore_proxy.functional.run import causal_inputs

    return chunk(tokens, *causal_inputs(*tokens.shape))


def _kl(teacher_logits, student_logits, keep):
    """Mean KL(teacher || student) in nats over the positions `keep` [b, s] marks."""
    import torch

    t = torch.log_softmax(teacher_logits[keep].float(), -1)
    s = torch.log_softmax(student_logits[keep].float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def canonical_tensors(chunk, proxy_view) -> dict:
    """The trained chunk's parameters under the proxy view's canonical names and dtypes."""
    from mcore_proxy.checkpoint.names import parse_local_key

    out = {}
    for key, value in chunk.state_dict_for_save_checkpoint().items():
        if key.endswith("_extra_state"):
            continue
        name = parse_local_key(key, 0, 0).canonical
        out[name] = value.detach().to(proxy_view.dtype(name)).contiguous()
    if set(out) != set(proxy_view.names()):
        missing, extra = sorted(set(proxy_view.names()) - set(out)), sorted(set(out) - set(proxy_view.names()))
        raise ProxyError(
            f"{proxy_view.info.path}: the model megatron-core builds from its args does not hold its tensors "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); distill supports the families `verify --functional` runs"
        )
    return out


def distill(
    orig: str | Path,
    proxy: str | Path,
    tokens: np.ndarray,
    out: str | Path,
    settings: DistillSettings = DistillSettings(),
    *,
    force: bool = False,
    progress=None,
) -> DistillResult:
    """Distil the proxy checkpoint at `proxy` against `orig` on `tokens` [N, S]; write the result to `out`."""
    import torch

    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.checkpoint.formats import write_checkpoint
    from mcore_proxy.checkpoint.view import DictModelView
    from mcore_proxy.core.output import check_output_path
    from mcore_proxy.functional.cpu import destroy_distributed, free_port
    from mcore_proxy.functional.family import enter_layout
    from mcore_proxy.functional.model import Layout

    start = time.perf_counter()
    source, proxy_view = (
        _one_rank(open_checkpoint(orig), "the original"),
        _one_rank(open_checkpoint(proxy), "the proxy"),
    )
    check_output_path(out, (orig, proxy), replace=force)  # refused before any work
    held = settings.held_out or max(1, len(tokens) // 10)
    if not 0 < held < len(tokens):
        raise ProxyError(f"--held-out {held} must leave rows to train on (the token file has {len(tokens)})")
    rows = torch.from_numpy(tokens.astype(np.int64))
    train_rows, test_rows = rows[:-held], rows[-held:]
    family = _family(source)
    if int(rows.min()) < 0 or int(rows.max()) >= family.vocab_size:
        raise ProxyError(
            f"token ids span {int(rows.min())}..{int(rows.max())}, "
            f"but the model's vocabulary is 0..{family.vocab_size - 1}"
        )

    def keep(t):
        return torch.ones_like(t, dtype=torch.bool) if settings.pad_id is None else t != settings.pad_id

    started = not torch.distributed.is_initialized()
    torch.manual_seed(settings.seed)
    try:
        enter_layout(0, 1, free_port(), family, Layout())
        teacher, student = _build(source).eval(), _build(proxy_view)
        with torch.no_grad():
            target = _forward(teacher, test_rows)
            before = float(_kl(target, _forward(student, test_rows), keep(test_rows)))
        student.train()
        opt = torch.optim.Adam(student.parameters(), lr=settings.lr)
        history = []
        order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(settings.seed))
        steps = range(settings.steps) if progress is None else progress(range(settings.steps))
        for step in steps:
            idx = order[(step * settings.batch + torch.arange(settings.batch)) % len(train_rows)]
            batch = train_rows[idx]
            with torch.no_grad():
                t = _forward(teacher, batch)
            loss = _kl(t, _forward(student, batch), keep(batch))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 10 == 0 or step == settings.steps - 1:
                history.append(round(float(loss), 6))
        student.eval()
        with torch.no_grad():
            after = float(_kl(target, _forward(student, test_rows), keep(test_rows)))
        tensors = canonical_tensors(student, proxy_view)
    finally:
        if started and torch.distributed.is_initialized():
            destroy_distributed()
    result = DistillResult(Path(out), len(train_rows), held, before, after, history)
    record = {
        "what": "a proxy distilled against its original: its weights are not the original's bit for bit",
        "original": str(orig),
        "proxy": str(proxy),
        "settings": dataclasses.asdict(settings),
        "rows_trained": len(train_rows),
        "held_out_rows": held,
        "kl_held_out": {"before": before, "after": after},
        "history_every_10_steps": history,
    }
    view = DictModelView(tensors, proxy_view.spec, info=proxy_view.info)  # written as the proxy was
    write_checkpoint(
        view,
        out,
        fmt="legacy",
        inputs=(orig, proxy),
        progress=False,
        replace=force,
        extra_files={DISTILL_FILE: json.dumps(record, indent=1) + "\n"},
    )
    result.seconds = time.perf_counter() - start
    return result
