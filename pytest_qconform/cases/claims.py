"""Whether a backend claims a combination: the one rule the suites (``require_claim``, a
``not claimed:`` skip) and the collection (``applicability``, a deselection) share."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pytest_qconform.backends.base import Capabilities, QuantSpec
from pytest_qconform.vocabulary import DtypeLabel

if TYPE_CHECKING:
    from pytest_qconform.hardware.targets import Target

DTYPE_LABELS: dict[torch.dtype, str] = {label.torch_dtype(): label.value for label in DtypeLabel}


def target_device(target: Target) -> torch.device:
    """The device a target's claims are asked about (an absent target's: the CPU's)."""
    return torch.device(target.torch_device or "cpu")


def unclaimed(
    caps: Capabilities,
    target: Target,
    spec: QuantSpec | None = None,
    dtype: torch.dtype | None = None,
    *,
    backward: bool = False,
    serialize: bool = False,
    out: str | None = None,
    explicit_absmax: bool = False,
    orientation: str | None = None,
    compiled: str | None = None,
    captured: str | None = None,
    dequantize: bool = False,
) -> list[str]:
    """What of (device, spec, dtype, backward, serialize, an ``out=`` buffer for operation
    ``out``, an explicit absmax, a weight ``orientation``, operation ``compiled`` under
    torch.compile, operation ``captured`` in a CUDA graph, a dequantize) ``caps`` does not claim; empty when all."""
    device = target_device(target)
    device_kind = "cuda" if device.type == "cuda" else device.type
    problems = []
    if device_kind not in caps.devices:
        problems.append(f"device {device_kind}")
    if spec is not None:
        if spec.format not in caps.formats:
            problems.append(f"format {spec.format}")
        if spec.blocksize not in caps.blocksizes:
            problems.append(f"blocksize {spec.blocksize}")
        if spec.double_quant and not caps.double_quant:
            problems.append("double quantization")
        if spec.format == "hqq4" and spec.axis not in caps.axes:
            problems.append(f"axis {spec.axis}")
        if spec.quant_storage not in caps.quant_storages:
            problems.append(f"quant_storage {spec.quant_storage}")
    if dtype is not None and dtype not in caps.dtypes:
        problems.append(f"dtype {DTYPE_LABELS.get(dtype, str(dtype))}")
    if dtype is torch.bfloat16 and not target.bf16:
        problems.append(f"bf16 on {target.arch} (the arch has no bf16)")
    if dequantize and not caps.dequantize:
        problems.append("dequantize (the library offers none)")
    if backward and not caps.backward:
        problems.append("backward")
    if serialize and not caps.serialize:
        problems.append("serialization")
    if out is not None and out not in caps.out_arguments:
        problems.append(f"{out} into an out= buffer")
    if explicit_absmax and not caps.explicit_absmax:
        problems.append("dequantize with an explicit absmax")
    if orientation is not None and orientation not in caps.weight_orientations:
        problems.append(f"the packed weight {orientation} in matmul")
    if compiled is not None and compiled not in caps.compiled:
        problems.append(f"{compiled} under torch.compile")
    if captured is not None and captured not in caps.captured:
        problems.append(f"{captured} captured in a CUDA graph")
    return problems
