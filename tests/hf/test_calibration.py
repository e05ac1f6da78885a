"""mcore_proxy/hf/calibration.py: a bad line of calibration data is one sentence naming the file and line."""

import pytest

from mcore_proxy.hf.calibration import records
from mcore_proxy.core.errors import ProxyError


@pytest.mark.parametrize(
    "line",
    [
        b"{not json",
        b"\xff\xfe{}",
        b"[" * 100_000 + b"]" * 100_000,
        # past Python's int parsing limit json raises a bare ValueError (exit 3 before)
        b'{"input_ids": [' + b"9" * 5000 + b"]}",
    ],
)
def test_a_bad_line_names_the_file_and_line(tmp_path, line):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"input_ids": [3, 4]}\n' + line + b"\n")
    with pytest.raises(ProxyError, match=r"data\.jsonl:2: not a JSON object"):
        list(records(path))


def _image(path, seed: int):
    import numpy as np
    from PIL import Image

    Image.fromarray((np.random.default_rng(seed).random((40, 60, 3)) * 255).astype("uint8")).save(path)
    return path.name


def _collect(orig, data, out) -> int:
    from mcore_proxy.cli import main

    return main(["collect", "--hf", str(orig), "--data", str(data), "-o", str(out)])


def test_image_text_records_route_their_image_tokens_through_the_experts(hf_model, tmp_path):
    """Aria's processor turns an image into 4 image tokens: they are counted and routed, and the
    pixels decide where (another image, same text: other expert counts)."""
    import json

    from mcore_proxy.core.stats import load_stats
    from mcore_proxy.hf.calibration import load_processor
    from mcore_proxy.testing.hf_fixtures import ARIA_IMAGE

    orig = hf_model("aria")
    text = f"the big cat {ARIA_IMAGE} sat under the green tree"
    tokenizer = load_processor(orig).tokenizer
    lengths = {n: len(tokenizer(n)["input_ids"]) for n in ("the red bird ran", text)}
    counts = []
    for seed in (0, 1):
        data = tmp_path / f"data{seed}.jsonl"
        record = {"text": text, "image": _image(tmp_path / f"{seed}.png", seed)}
        data.write_text(json.dumps({"text": "the red bird ran"}) + "\n" + json.dumps(record) + "\n")
        assert _collect(orig, data, tmp_path / f"stats{seed}") == 0
        stats = load_stats(tmp_path / f"stats{seed}" / "routing_stats.safetensors")
        layer = stats.layers["0"]
        # the placeholder became 4 image tokens, each routed to top-k experts
        assert layer.tokens == lengths["the red bird ran"] + lengths[text] - 1 + 4
        assert layer.freq.sum() == layer.tokens * stats.topk
        counts.append(layer.freq)
    assert (counts[0] != counts[1]).any()


@pytest.mark.parametrize(
    "fixture, record, says",
    [
        ("qwen3_moe", {"text": "the cat", "image": "0.png"}, "has no processor files"),
        ("aria", {"text": "the cat <|img|>", "image": "missing.png"}, r"data\.jsonl:1: image .*missing\.png could not"),
        ("aria", {"text": "the cat", "image": "0.png"}, r"data\.jsonl:1: the text lacks the model's image placeholder"),
        ("aria", {"text": "<|img|> the <|img|>", "image": "0.png"}, r"data\.jsonl:1: the model's processor refuses"),
    ],
)
def test_a_bad_image_text_record_is_one_sentence_and_exit_2(hf_model, tmp_path, capsys, fixture, record, says):
    import json
    import re

    _image(tmp_path / "0.png", 0)
    (tmp_path / "data.jsonl").write_text(json.dumps(record) + "\n")
    assert _collect(hf_model(fixture), tmp_path / "data.jsonl", tmp_path / "stats") == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mcore-proxy ")]
    assert len(lines) == 1 and re.search(says, lines[0])
    assert not (tmp_path / "stats" / "routing_stats.safetensors").exists()
