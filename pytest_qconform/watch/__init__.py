"""``watch(model)``: run any model, training loop or serving code under the call-site oracle.

    from pytest_qconform.watch import watch

    with watch(model, ["bitsandbytes"]) as oracle:   # every Linear4bit call judged
        model.generate(**inputs)
        loss = model(**batch).loss; loss.backward()
    print(oracle.summary())

Every quantized layer of ``model`` (and of any model passed to ``oracle.attach`` inside
the block) is hooked; each sampled call is judged against the float64 reference of the
layer's own bytes (``oracle``). Leaving the block raises ``WatchFailure`` naming the first
failing calls, their context and layer, or when no call was judged at all (a watch that
checked nothing must not pass). Under ``pytest --qconform`` the ``qwatch`` fixture does
the same and writes the calls into the run report. Docs: docs/watch.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from pytest_qconform.backends.base import Backend
from pytest_qconform.backends.layers import LayerFacet
from pytest_qconform.watch.context import CallContext
from pytest_qconform.watch.oracle import FIRST_CALLS, CallOracle, CallVerdict

__all__ = ["CallContext", "CallOracle", "CallVerdict", "WatchFailure", "layer_facets", "watch"]


class WatchFailure(AssertionError):
    """A watched call computed outside its bound or broke its contract, or nothing was judged."""


def layer_facets(backends: Sequence[str | Backend] | Mapping[str, LayerFacet] | None = None) -> dict[str, LayerFacet]:
    """``{backend name: layer facet}`` for ``backends`` (names, ``Backend`` objects, or that
    mapping itself); ``None``: every installed backend that loads here and offers a layer.
    A named backend that is unknown, cannot load or has no layer is an error naming why."""
    if isinstance(backends, Mapping):
        return dict(backends)
    from pytest_qconform.backends import registry

    explicit = backends is not None
    chosen: list[Backend] = []
    for entry in backends if backends is not None else sorted(registry.discover()):
        chosen.append(registry.create(entry) if isinstance(entry, str) else entry)
    facets: dict[str, LayerFacet] = {}
    for backend in chosen:
        availability = backend.availability()
        facet = backend.layers() if availability.available else None
        if facet is None:
            if explicit:
                why = availability.reason if not availability.available else "it offers no layer (Backend.layers())"
                raise ValueError(f"watch: backend {backend.name!r} cannot be watched here: {why}")
            continue
        facets[backend.name] = facet
    return facets


@contextmanager
def watch(
    model: torch.nn.Module,
    backends: Sequence[str | Backend] | Mapping[str, LayerFacet] | None = None,
    *,
    first_calls: int = FIRST_CALLS,
    require_calls: bool = True,
    on_detach: Callable[[CallOracle], None] | None = None,
) -> Iterator[CallOracle]:
    """Judge every sampled call of ``model``'s quantized layers while the block runs.
    ``on_detach``: called with the oracle when the block ends, however it ends (the
    ``qwatch`` fixture records the calls into the report there)."""
    oracle = CallOracle(layer_facets(backends), first_calls=first_calls)
    oracle.attach(model)
    try:
        yield oracle
    finally:
        oracle.detach()
        oracle.settle()
        if on_detach is not None:
            on_detach(oracle)
    conclude(oracle, require_calls=require_calls)


def conclude(oracle: CallOracle, *, require_calls: bool = True) -> None:
    """Raise ``WatchFailure`` for failed calls, or for a watch that judged nothing."""
    if oracle.failures:
        raise WatchFailure(oracle.failure_report())
    if require_calls and not oracle.verdicts:
        names = ", ".join(sorted(oracle.facets)) or "none"
        raise WatchFailure(
            f"watch judged no call: {oracle.layers} quantized layers of the watched backends ({names}) were found "
            "and none was called. Check that the model holds that backend's layers and that the block runs it."
        )
