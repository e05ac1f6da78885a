"""The pipeline-layout parser against megatron-core 0.16.1's own `PipelineParallelLayerLayout`.

megatron-core is imported but no process group is started: its parser is pure apart from one
read of the virtual-pipeline world size, which the comparison sets and restores.
"""

from __future__ import annotations

import random

import pytest

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.mcore.pipeline_layout import (
    noop_layer_ids,
    num_layer_list_stages,
    parse_pipeline_layout,
    split_stages,
    unroll,
)

mcore_layout = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.enums import LayerType  # noqa: E402

Megatron = mcore_layout.PipelineParallelLayerLayout

# (string, PP, decoder layers, MTP layers): real and documented layouts
VALID = [
    ("Et*3|(tt|)*29,m|L", 16, 61, 1),  # DeepSeek-V3 example of the megatron docs: VPP 2
    ("Ettt|tt|m|L", 2, 5, 1),  # the tiny DeepSeek fixture: MTP standalone, empty L stage
    ("Etttt|tmL", 2, 5, 1),
    ("E|(t|)*3,mm|L", 3, 3, 2),  # argparse help example with both m in one stage
    ("Ettt|tttL", 2, 6, 0),
    ("E|t*4|t*4|L", 4, 8, 0),  # first and last stage without decoder layers
    ("Et|t|t|tL", 2, 4, 0),  # PP 2 x VPP 2
    ("Et|t|tL", 3, 3, 0),
    ("E,t*2,|,t*2,L", 2, 4, 0),  # cosmetic commas
    ("Et*0|ttL", 2, 2, 0),  # *0 is accepted
    ("E(t)*2|(t)*2L", 2, 4, 0),
]


def _megatron_stages(text: str, pp: int, num_layers: int, mtp: int):
    """[(pp, vp, decoder ids, mtp ids)] by megatron-core's own methods, and mtp_standalone."""
    layout = Megatron(text, pp)
    standalone = layout.validate_layer_layout(num_layers, mtp or None)
    vpp = layout.virtual_pipeline_model_parallel_size
    saved = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    try:
        out = []
        for vp in range(vpp):
            for rank in range(pp):
                kw = dict(vp_stage=vp if vpp > 1 else None, pp_rank=rank)
                out.append(
                    (
                        rank,
                        vp,
                        tuple(layout.get_layer_id_list(LayerType.decoder, **kw)),
                        tuple(layout.get_layer_id_list(LayerType.mtp, **kw)),
                    )
                )
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(saved)
    return out, standalone, vpp


def _ours(text, pp, num_layers, mtp):
    layout = parse_pipeline_layout(text, pp, num_layers, mtp)
    return [(s.pp, s.vp, s.decoder, s.mtp) for s in layout.stages], layout.mtp_standalone, layout.vpp


@pytest.mark.parametrize("text,pp,num_layers,mtp", VALID)
def test_valid_layouts_match_megatron(text, pp, num_layers, mtp):
    assert _ours(text, pp, num_layers, mtp) == _megatron_stages(text, pp, num_layers, mtp)


def test_deepseek_v3_layout_reads_as_documented():
    layout = parse_pipeline_layout("Et*3|(tt|)*29,m|L", 16, 61, 1)
    assert (layout.pp, layout.vpp, len(layout.stages)) == (16, 2, 32)
    first, mtp, last = layout.stage(0, 0), layout.stage(14, 1), layout.stage(15, 1)
    assert first.decoder == (0, 1, 2) and first.embedding and not first.loss
    assert layout.stage(1, 0).decoder == (3, 4) and layout.stage(0, 1).decoder == (33, 34)
    assert mtp.decoder == () and mtp.mtp == (0,) and layout.mtp_standalone
    assert last.decoder == () and last.mtp == () and last.loss and not last.empty
    assert layout.final_norm_stage == layout.stage(13, 1)  # holds layers 59, 60
    assert layout.stage_of_layer(60) == (layout.stage(13, 1), 1)


def test_tiny_fixture_layout():
    layout = parse_pipeline_layout("Ettt|tt|m|L", 2, 5, 1)
    assert [(s.pp, s.vp, s.decoder, s.mtp, s.embedding, s.loss) for s in layout.stages] == [
        (0, 0, (0, 1, 2), (), True, False),
        (1, 0, (3, 4), (), False, False),
        (0, 1, (), (0,), False, False),
        (1, 1, (), (), False, True),
    ]
    assert layout.final_norm_stage.index == 1


def _random_string(rng: random.Random) -> str:
    alphabet = "EtmL|(),*0123" + "t" * 6 + "|" * 3
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))


def _megatron_outcome(text, pp):
    """megatron's split into stages (chars), or None when it refuses the string for this PP."""
    try:
        stages = Megatron.parse_str_to_list(text)
        Megatron(stages, pp)
    except (AssertionError, ValueError, KeyError):
        return None
    names = {
        v: k
        for k, v in {"E": LayerType.embedding, "t": LayerType.decoder, "m": LayerType.mtp, "L": LayerType.loss}.items()
    }
    return ["".join(names[x] for x in s) for s in stages]


def _our_outcome(text, pp):
    try:
        layout = parse_pipeline_layout(text, pp)
    except ProxyError:
        return None
    return [s.symbols for s in layout.stages]


def test_random_strings_parse_like_megatron():
    """Thousands of strings from the layout alphabet (most malformed): the same stages, or both refuse."""
    rng = random.Random(0)
    accepted = 0
    for _ in range(4000):
        text, pp = _random_string(rng), rng.choice([1, 2, 3])
        expected = _megatron_outcome(text, pp)
        assert _our_outcome(text, pp) == expected, text
        accepted += expected is not None
    assert accepted > 300  # the comparison covered many accepted strings too


def test_random_valid_layouts_validate_like_megatron():
    """Well-formed random layouts (with a wrong layer count now and then): the same verdict and stages."""
    rng = random.Random(1)
    for _ in range(600):
        pp, vpp = rng.choice([1, 2, 4]), rng.choice([1, 2])
        counts = [rng.randint(0, 3) for _ in range(pp * vpp)]
        mtp = rng.choice([0, 0, 1, 2])
        stages = ["t" * c for c in counts]
        stages[0] = "E" + stages[0]
        if mtp:
            at = rng.choice([len(stages) - 1, len(stages) - 2, len(stages) - 1 - pp])
            stages[at] += "m" * mtp
        stages[-1] += "L"
        text = "|".join(stages)
        num_layers = sum(counts) + rng.choice([0, 0, 0, 1])
        try:
            expected = _megatron_stages(text, pp, num_layers, mtp)
        except AssertionError:
            expected = None
        try:
            ours = _ours(text, pp, num_layers, mtp)
        except ProxyError:
            ours = None
        assert ours == expected, (text, pp, num_layers, mtp)


@pytest.mark.parametrize(
    "text,pp,layers,why",
    [
        ("Ettt|tq|L", 2, 4, "not one of"),
        ("Ettt|tt|L", 2, 5, "not a multiple"),
        ("tttE|L", 2, 3, "first symbol must be E"),
        ("Ett|tt", 2, 4, "last symbol must be L"),
        ("Etm|tL", 2, 2, "before the MTP"),
        ("Et|mL", 2, 3, "decoder layers"),
        ("Et|m|t|L", 2, 2, "before the MTP"),
    ],
)
def test_refusals_name_the_string(text, pp, layers, why):
    with pytest.raises(ProxyError, match=why) as err:
        parse_pipeline_layout(text, pp, layers, 1 if "m" in text else 0)
    assert repr(text) in str(err.value)


def test_unroll_and_split_are_megatrons_passes():
    assert unroll("(tt|)*2,m") == "tt|tt|m"
    assert unroll("|*3") == "|||"  # a bare separator repeated: empty stages
    assert unroll("(t*2)*2") == "tttt"  # '*' inside a group unrolls in the second pass
    assert split_stages("E||L") == ["E", "", "L"]
    with pytest.raises(ProxyError):
        split_stages("((t)*2)*2")  # groups do not nest


def test_num_layer_list_and_noop_layers():
    layout = num_layer_list_stages("1,3,3,1", 8, mtp_layers=1)
    assert [s.decoder for s in layout.stages] == [(0,), (1, 2, 3), (4, 5, 6), (7,)]
    assert layout.stage(3).mtp == (0,) and layout.stage(3).loss and layout.stage(0).embedding
    with pytest.raises(ProxyError, match="sums to 7"):
        num_layer_list_stages("1,3,3", 8)
    noop = noop_layer_ids({0, 7}, 8)
    assert noop == noop_layer_ids("0,7", 8) == frozenset({0, 7})
    assert layout.stage(0).real_layers(noop) == () and layout.stage(1).real_layers(noop) == ((0, 1), (1, 2), (2, 3))
    even = parse_pipeline_layout("Etttt|ttttL", 2)
    assert even.stage(1).real_layers(noop_layer_ids("4,5", 8)) == ((2, 6), (3, 7))  # gap at local 0, 1
    with pytest.raises(ProxyError, match="0..7"):
        noop_layer_ids("8", 8)
