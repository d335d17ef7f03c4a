"""Which backends exist: the built-in adapters plus installed entry points.

Nothing is imported until a factory is called, so listing backends costs nothing and a
broken adapter or plugin package cannot stop a run: a factory that fails to build its
backend returns an ``UnavailableBackend`` that reports why, and the suites skip it.
Packages register a backend with an entry point in the ``pytest_qconform.backends``
group whose value is a ``Backend`` subclass (or any callable returning a ``Backend``);
a conftest.py uses the ``pytest_qconform_backends`` hook instead.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any

import torch

from pytest_qconform.backends.base import Availability, Backend, Capabilities, Quantized, QuantSpec

ENTRY_POINT_GROUP = "pytest_qconform.backends"
BUILTIN_BACKENDS: dict[str, str] = {
    "bitsandbytes": "pytest_qconform.backends.bitsandbytes:BitsandbytesBackend",
    "hqq": "pytest_qconform.backends.hqq:HqqBackend",
    "hqq-gemlite": "pytest_qconform.backends.hqq_gemlite:HqqGemliteBackend",
}

BackendFactory = Callable[[], Backend]


class UnknownBackendError(LookupError):
    """``create`` was asked for a name no built-in adapter or entry point provides."""


class UnavailableBackend(Backend):
    """Stands in for a backend whose adapter could not be built; says why, does nothing."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    def availability(self) -> Availability:
        return Availability(False, None, self.reason)

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities(
            formats=(), blocksizes=(), double_quant=False, dtypes=(), devices=(), backward=False, serialize=False
        )

    def _refuse(self) -> RuntimeError:
        return RuntimeError(f"backend {self.name!r} is unavailable: {self.reason}")

    def quantize(self, weight: torch.Tensor, spec: QuantSpec) -> Quantized:
        raise self._refuse()

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        raise self._refuse()

    def matmul(
        self, x: torch.Tensor, q: Quantized, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> torch.Tensor:
        raise self._refuse()

    def export_packed(self, q: Quantized) -> Any:
        raise self._refuse()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"


def _build(name: str, where: str, load: Callable[[], Any]) -> Backend:
    """Call ``load()`` for a Backend class or factory and instantiate it; never raise."""
    try:
        target = load()
        backend = target()
    except Exception as exc:  # noqa: BLE001 - a broken adapter or plugin is reported, not raised
        return UnavailableBackend(name, f"{name}: {where} failed to load: {_first_line(exc)}")
    if not isinstance(backend, Backend):
        return UnavailableBackend(
            name, f"{name}: {where} gave {type(backend).__name__}, not a pytest_qconform.backends.base.Backend"
        )
    return backend


def _import_ref(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _builtin_factory(name: str, ref: str) -> BackendFactory:
    return lambda: _build(name, f"adapter {ref}", lambda: _import_ref(ref))


def _entry_point_factory(entry_point: importlib.metadata.EntryPoint) -> BackendFactory:
    return lambda: _build(entry_point.name, f"entry point {entry_point.value!r}", entry_point.load)


def _unavailable_factory(name: str, reason: str) -> BackendFactory:
    return lambda: UnavailableBackend(name, reason)


def discover() -> dict[str, BackendFactory]:
    """``{name: factory}`` for the built-in backends and every installed entry point.

    An entry point whose name is already taken does not replace the first one; it is
    listed as ``"<name> (<value>)"`` and reports the clash as its unavailability reason.
    """
    factories: dict[str, BackendFactory] = {name: _builtin_factory(name, ref) for name, ref in BUILTIN_BACKENDS.items()}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in factories:
            label = f"{entry_point.name} ({entry_point.value})"
            factories[label] = _unavailable_factory(
                label,
                (
                    f"entry point {entry_point.value!r} in group {ENTRY_POINT_GROUP!r} reuses the backend name "
                    f"{entry_point.name!r}; rename it in that package's entry points"
                ),
            )
            continue
        factories[entry_point.name] = _entry_point_factory(entry_point)
    return factories


def create(name: str) -> Backend:
    """Build backend ``name``; raise ``UnknownBackendError`` listing the known names."""
    factories = discover()
    if name not in factories:
        raise UnknownBackendError(
            f"unknown backend {name!r}; known backends: {', '.join(sorted(factories))}. Install the package that "
            f"provides it (entry point group {ENTRY_POINT_GROUP!r}) or return it from a pytest_qconform_backends "
            "hook in conftest.py"
        )
    return factories[name]()
