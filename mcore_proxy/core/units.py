"""One unit convention for sizes: binary prefixes (1 KiB = 2**10, 1 MiB = 2**20, 1 GiB = 2**30
bytes) in every text and progress bar, plain byte counts in JSON."""

from __future__ import annotations

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

# tqdm keyword arguments for a bar counting bytes: scaled by 1024, so it reads "MiB" and "GiB"
# like the text around it (tqdm's own prefixes are decimal unless told otherwise)
BYTES_PROGRESS = {"unit": "iB", "unit_scale": True, "unit_divisor": 1024}


def format_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit it fills: 3 * 2**30 -> '3.00 GiB', 1536 -> '1.50 KiB',
    512 -> '512 B'."""
    for unit, scale in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
