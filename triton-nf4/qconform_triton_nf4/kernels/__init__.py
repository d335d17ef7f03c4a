"""Our own Triton kernels for bitsandbytes-layout 4-bit weights (NF4 and FP4).

``dequantize_4bit`` (bit-identical to bitsandbytes), ``gemv_4bit`` (fused dequantize-matmul
for <= 32 rows: per-row kernels for one row, tensor cores (``nf4_mma``) from two),
``fused_rows_limit`` (up to how many rows that beats dequantize + GEMM) and
``WeightBuffer`` (a reusable dequantize buffer), and ``tc_gemm_4bit`` (``nf4_tc_gemm``: a
fused tensor-core GEMM for tens to thousands of rows, which ``plans.linear_plan`` routes to
up to ``tc_max_rows``, a threshold per arch class: 64 rows on sm_90, 0 where not measured), and
``ws_gemm_4bit`` (``nf4_ws_gemm``: a warp-specialized Gluon GEMM for Hopper, which the route
prefers from ``ws_min_rows`` to ``ws_max_rows``: 17 to 128 rows on sm_90, 256 for large
weights, where it reads x). The code
table is an argument, so NF4 and FP4 share every kernel. ``gemv_4bit_plan``,
``tc_gemm_4bit_plan`` and ``dequantize_4bit_plan`` validate the same arguments and return
the bound launches as a callable, for a caller that repeats the call (each entry point is
its plan, called once).

Run on CPU through Triton's interpreter: set ``TRITON_INTERPRET=1`` in the environment
BEFORE this package is first imported. Triton (3.6 and 3.9 checked) decides between the
compiler and the interpreter when ``@triton.jit`` decorates a kernel, which happens at
import; changing the variable afterwards does not affect kernels already defined.
``interpreter_active()`` reports which mode these kernels were built in; in the
interpreter, ``interpreter_calls`` spares helper calls Triton's re-patching. With CPU tensors
and the interpreter off, the kernels raise a RuntimeError saying so.

Some pieces are NVIDIA-only inline PTX: the gemv kernels look code values up with a warp
shuffle (``nf4_gemv.shuffle_code``), and the tensor-core kernel also multiplies with
``mma.sync`` (``nf4_mma``). ``nf4_gemv.ptx_shuffle_ok`` and ``nf4_mma.mma_ptx_ok`` allow
them only when compiling for an NVIDIA GPU; a ROCm build and the interpreter take portable
code instead (table loads; the products from the other lanes' values), so the same
source compiles for ROCm. ROCm builds are not routed to the tensor-core kernel.
"""

from qconform_triton_nf4.kernels import interpreter_calls
from qconform_triton_nf4.kernels.nf4_dequant import (
    SUPPORTED_BLOCKSIZES,
    dequantize_4bit,
    dequantize_4bit_plan,
    interpreter_active,
)
from qconform_triton_nf4.kernels.nf4_gemv import MAX_ROWS, fused_rows_limit, gemv_4bit, gemv_4bit_plan
from qconform_triton_nf4.kernels.nf4_quantize import CodeBoundaries, code_boundaries, quantize_4bit
from qconform_triton_nf4.kernels.nf4_tc_gemm import (
    TcConfig,
    tc_gemm_4bit,
    tc_gemm_4bit_plan,
    tc_gemm_readable,
    tc_max_rows,
)
from qconform_triton_nf4.kernels.nf4_ws_gemm import (
    WsConfig,
    ws_gemm_4bit,
    ws_gemm_4bit_plan,
    ws_gemm_readable,
    ws_max_rows,
    ws_min_rows,
)
from qconform_triton_nf4.kernels.weight_buffer import WeightBuffer

if interpreter_active():
    interpreter_calls.install()

__all__ = [
    "MAX_ROWS",
    "SUPPORTED_BLOCKSIZES",
    "CodeBoundaries",
    "TcConfig",
    "WeightBuffer",
    "code_boundaries",
    "dequantize_4bit",
    "dequantize_4bit_plan",
    "fused_rows_limit",
    "gemv_4bit",
    "gemv_4bit_plan",
    "quantize_4bit",
    "tc_gemm_4bit",
    "tc_gemm_4bit_plan",
    "tc_gemm_readable",
    "tc_max_rows",
    "WsConfig",
    "ws_gemm_4bit",
    "ws_gemm_4bit_plan",
    "ws_gemm_readable",
    "ws_max_rows",
    "ws_min_rows",
    "interpreter_active",
]
