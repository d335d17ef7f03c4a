"""The linear layer and its gradients, in float64.

    y  = x W^T + b                     x: (..., K), W: (N, K), b: (N,)
    dx = dy W                          (..., K)
    dW = dy^T x  (leading dims flattened)   (N, K)
    db = sum of dy over the leading dims     (N,)

Everything is converted to float64 on ``x``'s device. The float64 result is within
``K * 2**-53`` relative of the exact sum of products, far below any bound a 4-bit
backend is held to (``bounds``), so it stands in for the exact value.

NaN and Inf follow IEEE arithmetic exactly: a row of x (or a row of W) holding a
non-finite entry is recomputed as an explicit elementwise sum, because a BLAS may skip
``0 * Inf`` terms that IEEE makes NaN.
"""

from __future__ import annotations

import torch

__all__ = ["linear", "linear_backward"]


def _f64(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().to(device=device, dtype=torch.float64)


def _ieee_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` for 2-D float64 a (M, K), b_t (N, K), exact IEEE NaN/Inf semantics."""
    out = a @ b_t.T
    bad_rows = ~torch.isfinite(a).all(dim=1)
    bad_cols = ~torch.isfinite(b_t).all(dim=1)
    if bool(bad_rows.any()):
        rows = bad_rows.nonzero().flatten()
        out[rows] = (a[rows].unsqueeze(1) * b_t.unsqueeze(0)).sum(dim=-1)
    if bool(bad_cols.any()):
        cols = bad_cols.nonzero().flatten()
        for start in range(0, a.shape[0], 256):  # bounded memory: 256 rows at a time
            chunk = a[start : start + 256]
            out[start : start + 256, cols] = (chunk.unsqueeze(1) * b_t[cols].unsqueeze(0)).sum(dim=-1)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` in float64, for x of any leading dims; shape ``(..., N)``."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"linear: x {tuple(x.shape)} and W {tuple(w.shape)} do not chain: need x (..., K) and W (N, K)"
        )
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise ValueError(f"linear: bias shape {tuple(b.shape)}, expected ({w.shape[0]},)")
    dev = x.device
    x2 = _f64(x, dev).reshape(-1, x.shape[-1])
    y = _ieee_matmul(x2, _f64(w, dev))
    if b is not None:
        y = y + _f64(b, dev)
    return y.reshape(*x.shape[:-1], w.shape[0])


def linear_backward(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dW, db)`` of ``y = x W^T + b`` for the upstream gradient ``dy``, float64:
    ``dx = dy W``, ``dW = dy^T x`` and ``db = sum(dy)`` over the leading dims."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or tuple(dy.shape) != (*x.shape[:-1], w.shape[0]):
        raise ValueError(
            f"linear_backward: x {tuple(x.shape)}, W {tuple(w.shape)}, dy {tuple(dy.shape)} do not "
            "match: need x (..., K), W (N, K), dy (..., N)"
        )
    dev = x.device
    x2 = _f64(x, dev).reshape(-1, x.shape[-1])
    dy2 = _f64(dy, dev).reshape(-1, w.shape[0])
    w64 = _f64(w, dev)
    dx = _ieee_matmul(dy2, w64.T.contiguous()).reshape(x.shape)
    dw = _ieee_matmul(dy2.T.contiguous(), x2.T.contiguous())
    db = dy2.sum(dim=0)
    return dx, dw, db
