"""HQQ as users deploy it on a GPU: an ``HQQLinear`` converted to gemlite's Triton kernels.

HQQ's ``prepare_for_inference(model, backend="gemlite")`` replaces each ``HQQLinear`` with
``hqq.backends.gemlite.patch_hqq_to_gemlite(layer, ...)``, which calls gemlite's
``A16Wn(device).from_hqqlinear(layer)``. This adapter does exactly that to a layer HQQ
quantized (``BaseQuantizeConfig(nbits=4, group_size, axis=1)``, compute dtype = the
weight's dtype, HQQ's PyTorch backend) and then only calls the converted layer. It never
repairs the input: an fp32 activation goes into an fp16 layer as it would in a model.

What gemlite supports, and so what is claimed (gemlite 0.6, helper.py and core.py):

- axis 1 only (``from_hqqlinear`` asserts it); ``in_features`` a multiple of 32 and of the
  group size, group size >= 16: HQQ's 32, 64 and 128 are claimed;
- the layer's dtype is HQQ's scale dtype: fp16 and bf16 are claimed (gemlite's kernels and
  autotune configs are written for 16-bit activations; fp32 is not claimed);
- CUDA only (Triton kernels; HQQ's conversion packs on the GPU);
- no dequantize: ``GemLiteLinearTriton`` has only its forward, so dequantize cells are not
  claimed and the converted bytes are checked through matmul (the layer's forward), decoded
  by ``reference.gemlite4``; no backward (the forward is a custom op without a gradient),
  no serialization claim;
- the forward routes by the number of activation rows: a gemv (``GEMV_REVSPLITK``) up to
  4 rows, ``GEMM_SPLITK`` from 5, ``GEMM`` from 64 (``core.get_matmul_type``);
- ``torch.compile`` and CUDA graphs: gemlite's forward is a custom op with a fake
  implementation, written for both, so matmul is claimed compiled and captured.
- autotune: on an sm90 GPU the configs gemlite's autotune chose for the suite's shapes there
  are loaded first (``gemlite_configs``), so a cold run does not benchmark every config of
  every key, and each key runs on the same kernel config run after run.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from pytest_qconform.backends import gemlite_configs
from pytest_qconform.backends.adapter_helpers import dtype_name, import_failure, to_numpy
from pytest_qconform.backends.base import Availability, Backend, Capabilities, Quantized, QuantSpec
from pytest_qconform.backends.handles import GemliteHandle
from pytest_qconform.backends.hqq import _pytorch_backend
from pytest_qconform.reference.packed import PackedGemlite4

GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
MATMUL_ROUTES: tuple[int, ...] = (5, 64)  # GEMM_SPLITK from 5 rows, GEMM from 64
INSTALL_HINT = "pip install 'pytest-qconform[gemlite]' on a CUDA machine"


class HqqGemliteBackend(Backend):
    name = "hqq-gemlite"

    def availability(self) -> Availability:
        try:
            for module in ("hqq", "gemlite"):
                if importlib.util.find_spec(module) is None:
                    return Availability(False, None, f"{module} is not installed ({INSTALL_HINT})")
            import gemlite
            import hqq.backends.gemlite  # noqa: F401 - HQQ's conversion imports gemlite's helper
        except Exception as exc:  # noqa: BLE001 - gemlite asks Triton for a GPU driver on import: reported
            return Availability(False, None, import_failure(self.name, exc))
        return Availability(True, str(getattr(gemlite, "__version__", "unknown")))

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities(
            formats=("hqq4",),
            blocksizes=GROUP_SIZES,
            double_quant=False,
            dtypes=DTYPES,
            devices=("cuda",),
            backward=False,
            serialize=False,
            dispatch_rows=MATMUL_ROUTES,
            axes=(1,),
            compiled=("matmul",),
            captured=("matmul",),
            dequantize=False,
        )

    def quantize(self, weight: torch.Tensor, spec: QuantSpec) -> Quantized:
        from hqq.core.quantize import BaseQuantizeConfig

        where = f"{self.name}.quantize"
        self._check(spec, where)
        if weight.dim() != 2 or weight.device.type != "cuda":
            raise ValueError(
                f"{where}: needs a 2-D weight on a CUDA device, got {tuple(weight.shape)} on {weight.device}"
            )
        gemlite_configs.load_recorded(weight.device)
        out_features, in_features = weight.shape
        linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
        linear.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        config = BaseQuantizeConfig(nbits=4, group_size=spec.blocksize, axis=1)
        with _pytorch_backend() as hqq_linear:
            layer = hqq_linear(linear, config, compute_dtype=weight.dtype, device=str(weight.device))
        state = {k: v.detach().clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
        handle = GemliteHandle(self._convert(layer), state, weight.dtype)
        return Quantized(self.name, spec, tuple(weight.shape), weight.device, handle)

    @staticmethod
    def _check(spec: QuantSpec, where: str) -> None:
        if spec.format != "hqq4" or spec.double_quant or spec.axis != 1:
            raise ValueError(f"{where}: gemlite converts HQQ 4-bit layers of axis 1 only, got {spec}")

    def convert_linear(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: QuantSpec,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> Any:
        """The layer facet's build: an ``HQQLinear`` quantized on ``device`` from an
        ``nn.Linear`` holding ``weight`` and ``bias`` (as transformers or HQQ's own loader
        builds it), then converted as ``prepare_for_inference(backend="gemlite")`` converts
        it, bias included."""
        from hqq.core.quantize import BaseQuantizeConfig

        self._check(spec, "hqq-gemlite layer")
        if device.type != "cuda":
            raise ValueError(f"hqq-gemlite layer: gemlite computes on CUDA only, got {device}")
        gemlite_configs.load_recorded(device)
        out_features, in_features = weight.shape
        linear = torch.nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight.detach().cpu().clone(), requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias.detach().cpu().clone(), requires_grad=False)
        config = BaseQuantizeConfig(nbits=4, group_size=spec.blocksize, axis=1)
        with _pytorch_backend() as hqq_linear:
            layer = hqq_linear(linear, config, compute_dtype=compute_dtype, device=str(device))
        return self._convert(layer)

    @staticmethod
    def _convert(layer: Any) -> Any:
        """HQQ's own conversion, as ``prepare_for_inference(..., backend="gemlite")`` calls it."""
        from hqq.backends.gemlite import patch_hqq_to_gemlite

        return patch_hqq_to_gemlite(layer, None)

    def _layer_for(self, q: Quantized, compute_dtype: torch.dtype) -> Any:
        """The converted layer; at another compute dtype, the HQQ checkpoint loaded with that
        ``compute_dtype`` (as transformers loads it) and converted again."""
        handle: GemliteHandle = q.handle
        if compute_dtype == handle.dtype:
            return handle.layer
        from hqq.core.quantize import HQQLinear

        with _pytorch_backend():
            sibling = HQQLinear(None, None, compute_dtype=compute_dtype, device=str(q.device), initialize=False)
            sibling.load_state_dict(dict(handle.hqq_state))
        return self._convert(sibling)

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError(f"{self.name}: GemLiteLinearTriton has no dequantize (not claimed)")

    def matmul(
        self, x: torch.Tensor, q: Quantized, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> torch.Tensor:
        """``layer(x)`` with ``layer.bias`` set for the call (gemlite adds it in its forward)."""
        layer = self._layer_for(q, compute_dtype)
        previous = layer.bias
        layer.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        try:
            return layer(x)
        finally:
            layer.bias = previous

    def export_packed(self, q: Quantized) -> PackedGemlite4:
        return self.packed_of(q.handle.layer)

    @staticmethod
    def packed_of(layer: Any) -> PackedGemlite4:
        """gemlite's ``W_q`` words, ``scales`` and ``zeros`` as the converted layer stores
        them, and the dequantization mode it runs with (bf16 widened to fp32 exactly)."""
        return PackedGemlite4(
            shape=(int(layer.out_features), int(layer.in_features)),
            group_size=int(layer.group_size),
            packed=to_numpy(layer.W_q),
            scale=to_numpy(layer.scales),
            zero=to_numpy(layer.zeros),
            group_mode=int(layer.W_group_mode),
            channel_scale_mode=int(layer.channel_scale_mode),
            elements_per_sample=int(layer.elements_per_sample),
            meta={
                "compute_dtype": dtype_name(layer.compute_dtype),
                "scale_dtype": dtype_name(layer.scales.dtype),
                "zero_dtype": dtype_name(layer.zeros.dtype),
            },
        )

    def layers(self) -> Any:
        """``GemLiteLinearTriton`` (``gemlite_layer.GemliteLayers``): the layer a converted
        model holds, so the layer suites and the call-site oracle reach it."""
        from pytest_qconform.backends.gemlite_layer import GemliteLayers

        return GemliteLayers(self)
