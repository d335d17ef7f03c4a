"""Why bitsandbytes' fp16 4-bit matmul returns NaN where the exact result is small.

The suite's ``test_fp16_overflow_inside_kernel_stays_finite`` feeds products of about
2.4e5 (over fp16's 65504) that cancel in pairs. This script separates the candidates on
a CUDA device: bitsandbytes' ``matmul_4bit`` against ``torch.nn.functional.linear`` on
the same dequantized fp16 weight, with torch's
``allow_fp16_reduced_precision_reduction`` on (torch's default) and off.

    PYTHONPATH=. python bench/diagnose_fp16_overflow.py
"""

from __future__ import annotations

import torch


def main() -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    dev = torch.device("cuda")
    base = torch.randn(32, 64, generator=torch.Generator().manual_seed(1234)).double()
    w = base.repeat_interleave(2, 0).repeat_interleave(2, 1)
    w = (w / w.abs().max() * 8.0).float().to(dev)
    q, state = F.quantize_4bit(w.half(), blocksize=64, quant_type="nf4")
    w16 = F.dequantize_4bit(q, state).half()
    for rows in (1, 2, 16):
        x = torch.full((rows, 128), 30000.0, dtype=torch.float16, device=dev)
        x[:, 1::2] = -30000.0
        exact = x.double() @ w16.double().T
        for flag in (True, False):
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = flag
            y_bnb = bnb.matmul_4bit(x, q.t(), quant_state=state)
            y_lin = torch.nn.functional.linear(x, w16)
            print(
                f"rows={rows} reduced_precision_reduction={flag}: "
                f"bnb nan={int(torch.isnan(y_bnb).sum())} inf={int(torch.isinf(y_bnb).sum())} | "
                f"F.linear nan={int(torch.isnan(y_lin).sum())} inf={int(torch.isinf(y_lin).sum())} | "
                f"max|exact|={exact.abs().max().item():.3g}"
            )
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True


if __name__ == "__main__":
    main()
