"""AMD machine-code instructions known to round a bf16 result other than to nearest even.

Why: a kernel's bf16 arithmetic is only as right as the instructions the compiler picks,
and a truncating one is invisible to a compile that succeeds. Triton lowered a bf16
multiply on RDNA (gfx11, gfx12) to ``v_dot2_bf16_bf16`` with the second lane zeroed, from
triton-lang/triton#8444 (October 2025) until #11227 (August 2026); that instruction writes
its result truncated, so every product rounds toward zero (measured on gfx1200 in
triton-lang/triton#11217: 100 % of 2^20 products match truncation, 52.5 % match
round-to-nearest-even). The compile check scans the machine code of every variant it
compiles for an AMD arch; a hit marks that arch's bf16 results of our kernels as
expected to fail the rounding check (``reference.bounds.rounding_direction_biased``),
before any runner computes them.
"""

from __future__ import annotations

TRUNCATING_BF16: dict[str, str] = {
    "v_dot2_bf16_bf16": (
        "writes its bf16 result truncated, not rounded to nearest even "
        "(triton-lang/triton#11217; Triton emitted it for bf16 multiplies on RDNA "
        "from #8444 until #11227)"
    ),
}


def truncating_instructions(amdgcn: str) -> tuple[str, ...]:
    """The instructions of ``TRUNCATING_BF16`` that the AMDGCN assembly executes, sorted."""
    found = set()
    for line in amdgcn.splitlines():
        words = line.split(maxsplit=1)
        if words and words[0] in TRUNCATING_BF16:
            found.add(words[0])
    return tuple(sorted(found))
