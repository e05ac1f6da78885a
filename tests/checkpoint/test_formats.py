"""The format table and the ModelView contract (issue 9): one row per format drives detection,
opening, the CLI's choices and writing; a view that forgets a method fails at construction."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_proxy.checkpoint import DictModelView, ModelView, ViewInfo, open_checkpoint, write_checkpoint
from mcore_proxy.checkpoint.formats import FORMATS, format_names, get_format
from mcore_proxy.checkpoint.interface import Format, Writer
from mcore_proxy.checkpoint.target import resolve_target
from mcore_proxy.cli import build_parser
from mcore_proxy.core.errors import ProxyError
from mcore_proxy.testing.synthetic import SyntheticMoEView, synthetic_args


def small_view():
    return SyntheticMoEView(synthetic_args(num_layers=2, hidden=64, experts=4, ffn=32, heads=4, vocab=256))


def test_every_row_is_a_complete_format_and_the_cli_offers_exactly_the_writable_ones():
    assert [f.name for f in FORMATS] == ["torch_dist", "legacy", "hf"]
    for fmt in FORMATS:
        assert isinstance(fmt, Format) and isinstance(fmt.writer, Writer) and callable(fmt.detect)
        assert get_format(fmt.name) is fmt
    convert = build_parser()._subparsers._group_actions[0].choices["convert"]
    choices = next(a.choices for a in convert._actions if a.dest == "format")
    assert tuple(choices) == format_names(writable=True) == ("torch_dist", "legacy", "hf")
    with pytest.raises(ProxyError, match="format 'gguf' is not one of torch_dist, legacy, hf"):
        get_format("gguf")


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])  # hf: tests/checkpoint/hf (a family's names)
def test_each_format_writes_what_it_reads(tmp_path, fmt):
    view = small_view()
    out = write_checkpoint(view, tmp_path / "out", resolve_target(view, tp=2, pp=2, ep=2), fmt, progress=False)
    back = open_checkpoint(out)
    assert back.info.format == fmt and back.iteration == 100 and sorted(back.names()) == sorted(view.names())
    for name in view.names():
        assert back.shape(name) == view.shape(name) and back.dtype(name) == view.dtype(name)
        assert torch.equal(back.get(name), view.get(name)), name


def test_a_view_that_forgets_a_method_fails_at_construction():
    class NoDtype(ModelView):
        def names(self):
            return []

        def shape(self, name):
            return None

        def get(self, name):
            return None

    info = ViewInfo(spec=small_view().spec, format="memory")
    with pytest.raises(TypeError, match="abstract method.*dtype"):
        NoDtype(info)
    with pytest.raises(TypeError, match="needs a ViewInfo"):
        DictModelView.__init__(object.__new__(DictModelView), {}, spec=None, info={"format": "x"})


def test_the_view_record_is_one_frozen_dataclass_that_derived_views_replace():
    view = small_view()
    assert dataclasses.is_dataclass(view.info) and view.info.format == "synthetic"
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.info.format = "other"
    memory = DictModelView({"a": torch.zeros(2, 3)}, view.spec, args=view.args, iteration=7)
    assert (memory.info.format, memory.iteration, memory.shape("a"), memory.dtype("a")) == (
        "memory",
        7,
        (2, 3),
        torch.float32,
    )
