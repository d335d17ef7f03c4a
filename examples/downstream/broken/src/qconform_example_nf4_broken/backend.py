"""The correct example backend with ONE planted bug: dequantize reads the nibbles swapped.

Packing is untouched (the first element of each pair goes into the high nibble, as in
bitsandbytes), so the exported bytes are right and the reference decodes them right;
only this backend's own decoding takes the low nibble first. Every dequantize cell
must fail (and matmul, which decodes the same way), while quantize, which checks the
stored bytes, still passes: the suites point at the operation that is wrong.
"""

from __future__ import annotations

import torch
from qconform_example_nf4.backend import TorchNF4Backend


class SwappedNibblesNF4Backend(TorchNF4Backend):
    name = "torch-nf4-broken"

    def unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        # The planted bug: low nibble first (the correct order is ``packed >> 4`` first).
        return torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:numel]
