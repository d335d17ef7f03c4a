"""A downstream project's own model, run under pytest-qconform's call-site oracle.

What a project that ships its own 4-bit layer does to check it where its code calls it:
build its model with its layers, run what it runs (a training step, an evaluation, a
serving call under ``inference_mode``) inside ``watch``, and fail when any judged call is
outside its float64 bound. ``nox -s downstream`` runs it on the example backend (exit 0)
and on its broken twin (exit 1, naming the failing call).

    python watch_model.py --backend torch-nf4
"""

from __future__ import annotations

import argparse
import sys

import torch

from pytest_qconform.backends.spec import QuantSpec
from pytest_qconform.watch import WatchFailure, layer_facets, watch


class TinyModel(torch.nn.Module):
    """An embedding, two quantized layers with a GELU between them, and a float head."""

    def __init__(self, facet, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(32, 64, dtype=dtype)

        def quantized(n: int, k: int) -> torch.nn.Module:
            weight, bias = torch.randn(n, k, generator=gen) * 0.1, torch.randn(n, generator=gen) * 0.1
            return facet.quantize(weight, bias, QuantSpec("nf4", 64), dtype, torch.device("cpu"))

        self.up, self.down = quantized(128, 64), quantized(64, 128)
        self.head = torch.nn.Linear(64, 32, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.down(torch.nn.functional.gelu(self.up(h))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch-nf4", help="a registered backend offering a layer")
    args = parser.parse_args()
    facets = layer_facets([args.backend])
    model = TinyModel(facets[args.backend], torch.float32)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    try:
        with watch(model, facets) as oracle:
            model.train()
            torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            model.eval()
            with torch.inference_mode():
                model(tokens[:, -1:])
    except WatchFailure as failure:
        print(f"watch: {args.backend} computed outside its bound:\n{failure}", file=sys.stderr)
        return 1
    for backend, found in oracle.summary().items():
        print(f"watch: {backend}: {found['judged']} of {found['seen']} calls judged, none failed")
        for signature, count in found["contexts"].items():
            print(f"  {count:3d}  {signature}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
