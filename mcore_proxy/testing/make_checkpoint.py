"""Build one of the named tiny Megatron checkpoints with megatron-core on CPU.

    python -m mcore_proxy.testing.make_checkpoint deepseek_like_pp2_uneven OUT

Writes OUT (a legacy checkpoint saved by megatron-core in spawned gloo ranks) and
OUT.logits.pt (the model's logits on fixed tokens, for functional checks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcore_proxy.testing.build import save_checkpoint
from mcore_proxy.testing.fixtures import FIXTURES


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(FIXTURES))
    ap.add_argument("out")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if out.exists():
        print(f"make_checkpoint: error: {out}: already exists; choose a new path", file=sys.stderr)
        return 2
    model, layout = FIXTURES[a.name]
    ref = save_checkpoint(model, layout, out)
    print(
        f"saved {a.name} ({layout.world_size} gloo ranks, TP={layout.tp} PP={layout.pp} EP={layout.ep}) "
        f"to {out}; reference logits {ref}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
