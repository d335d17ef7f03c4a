"""Device debug (bench/notes.md v6c): one-hot x against each column, so every gemv output
is one code lookup; prints the columns where the word kernel's lookups go wrong, per
lookup mode. Run on a CUDA machine from the repo root:
``PYTHONPATH=. python bench/shfl_lookup_debug.py``."""
import torch
from pytest_qconform import kernels
from pytest_qconform.kernels import nf4_gemv
dev = "cuda"
code = torch.arange(16, dtype=torch.float32, device=dev) * 10 - 70
N, K = 8192, 512
packed = torch.randint(0, 256, (N * K // 2,), dtype=torch.uint8, device=dev)
absmax = torch.ones(N * K // 64, device=dev)
nib = torch.stack([packed >> 4, packed & 15], 1).reshape(N, K).long()
for lookup in ("gather", "shuffle"):
    nf4_gemv._WORDS_LOOKUP = lookup
    bad = []
    for c in range(0, 64):
        x = torch.zeros(1, K, device=dev, dtype=torch.float32); x[0, c] = 1
        y = kernels.gemv_4bit(x, packed, absmax, blocksize=64, shape=(N, K), code=code)
        want = code[nib[:, c]]
        if not torch.equal(y[0], want):
            wrong = (y[0] != want).nonzero().flatten()
            r = wrong[0].item()
            bad.append((c, len(wrong), r, y[0, r].item(), want[r].item()))
    print(lookup, "bad columns:", len(bad), bad[:12])
