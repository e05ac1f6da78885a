#!/usr/bin/env python3
"""Write the table of every Mixture-of-Experts architecture in docs/families.md, from mcore-proxy's
registry and the installed transformers.

    python tools/families_table.py           (re)write the table between its markers
    python tools/families_table.py --check   exit 1 with one line if the table is stale

Every causal-LM model type transformers ships whose config counts routed experts gets a row: the
family that reads it (declared in `checkpoint/hf/families.py`, or discovered from transformers by
`checkpoint/hf/discovery.py`), the twin proof (`convert/twin.py`) of the discovered record,
whether HF <-> Megatron is mapped, and whether the vLLM tier serves it. Discovery and the proof run
on every type, declared ones too (a declaration wins, but discovery is checked against it). Types
whose default config describes no MoE model get the few settings the Hub's configs set
(`DEFAULT_MOE`). About two minutes on two cores.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "families.md"
BEGIN, END = "<!-- families-table:begin -->", "<!-- families-table:end -->"

# model types whose default config is no MoE model, or one transformers cannot build: what the
# Hub's configs of that family set (a checkpoint's own config.json needs none of this)
DEFAULT_MOE = {
    "dots1": dict(n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1),
    "gemma4_text": dict(enable_moe_block=True, num_experts=16, top_k_experts=2, moe_intermediate_size=32),
    "hunyuan_v1_moe": dict(num_experts=16, moe_topk=2),
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=2),
    "lfm2_moe": dict(layer_types=(["conv", "conv", "full_attention"] * 20)[:32]),
    # GLM-4.5V's config.json sets head_dim 128, for which its rotary split [8, 12, 12] is sized
    "glm4v_moe": dict(text_config=dict(head_dim=128)),
    "qwen4_exp_text": dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4
    ),
}


def moe_types() -> list[tuple[str, str, dict]]:
    """(model type, architecture, default config dict) of every MoE type transformers ships: the
    causal LMs by model type, then the vision-language wrappers (image-text-to-text heads) whose
    text model counts routed experts."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    text_only = _moe_entries(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, wrapper=False)
    return text_only + _moe_entries(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, wrapper=True)


def _moe_entries(names: dict, wrapper: bool) -> list[tuple[str, str, dict]]:
    """The MoE entries of one of transformers' auto mappings: configs whose text part (all of it,
    or a wrapper's text config) counts experts."""
    import transformers

    from mcore_proxy.checkpoint.hf.twin import expert_count_keys

    out = []
    for model_type, arch in sorted(names.items()):
        try:
            config = transformers.CONFIG_MAPPING[model_type]()
            text = config.get_text_config()
        except Exception:  # a config transformers cannot make at its defaults, or several text configs
            continue
        if (text is not config) != wrapper:  # a wrapper under a causal-LM head: its text type has the row
            continue
        data = _merged(config.to_dict(), DEFAULT_MOE.get(model_type, {}))
        if expert_count_keys(text.to_dict() if wrapper else data):
            out.append((model_type, arch, dict(data, model_type=model_type, architectures=[arch])))
    return out


def _merged(config: dict, settings: dict) -> dict:
    """`config` with `settings` set, into its sub-configs too (`text_config`)."""
    out = dict(config)
    for key, value in settings.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def row(model_type: str, arch: str, data: dict, rollout_types: set[str]) -> str:
    from mcore_proxy.checkpoint.hf.config import HFConfig
    from mcore_proxy.checkpoint.hf.discovery import NotDiscovered, discover
    from mcore_proxy.checkpoint.hf.families import declared
    from mcore_proxy.checkpoint.hf.families import family_of
    from mcore_proxy.checkpoint.hf.native import StateDictView, read_with_family
    from mcore_proxy.convert.twin import prove, saved_twin

    reader = None
    try:
        discover(HFConfig(data, Path(f"<{model_type}>") / "config.json"))
        proof = prove(arch)
        # the measured difference moves in its last digits with the thread count: the row says the bound
        proven = "proven" if proof.passed else f"fails: {proof.why}"
        state, config = saved_twin(arch)
        reader = read_with_family(config, family_of(config), lambda f: StateDictView(state, config, f)).family
    except NotDiscovered as err:
        proven = "not discovered: " + str(err).split(": ", 1)[1].split("; every family")[0]
        reader = declared(arch)  # where discovery cannot decide, a declaration reads the family
    except Exception as err:  # the saved twin not read by any family: the reason, in the row
        reader, proven = None, f"{proven}; its saved spelling is not read ({type(err).__name__})"
    if reader is None:
        read = "refused"
    else:
        read = "discovered" if reader.origin == "discovered" else f"declared: {reader.name}"
    mapping = reader.megatron if reader is not None and reader.origin == "declared" else None
    megatron = "yes" if mapping is not None and arch in mapping.architectures else ""
    vllm = "tested" if model_type in rollout_types else ""
    return (
        f"| `{model_type}` | `{arch}` | {read} | {' '.join(proven.split()).replace('|', '/')} | {megatron} | {vllm} |"
    )


def rollout_types() -> set[str]:
    """Model types the vLLM tier serves (tests/rollout/test_vllm.py: the `@vllm` fixtures)."""
    import transformers

    from mcore_proxy.testing.hf_fixtures import MODELS, ROLLOUT_SIZES

    return {getattr(transformers, MODELS[name][0]).model_type for name in ROLLOUT_SIZES}


def table() -> str:
    import transformers

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    served = rollout_types()
    rows = [row(*entry, served) for entry in moe_types()]
    read = sum("| refused |" not in r and "| fails:" not in r for r in rows)
    return "\n".join(
        [
            f"Generated by `python tools/families_table.py` against transformers {transformers.__version__}: "
            f"{len(rows)} MoE types (causal LMs, then vision-language wrappers whose text model has "
            f"experts), {read} read by mcore-proxy (declared, or discovered and proven on a twin).",
            "",
            "| model type | architecture | read by | twin proof | HF <-> Megatron | vLLM |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )


def render(text: str, generated: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{generated}\n{END}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/families.md's table is stale")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    current = DOC.read_text()
    wanted = render(current, table())
    if args.check:
        if wanted != current:
            print(f"{DOC}: the families table is stale; run python tools/families_table.py")
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
