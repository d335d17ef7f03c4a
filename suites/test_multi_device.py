"""Tensors on another GPU than the current one (issue 37): a model loaded with
``device_map="auto"`` computes its second half on ``cuda:1`` while ``cuda:0`` stays the
current device, and the reverse happens in any process that set its device to 1.

Kernels launched on the current device and its stream rather than the tensor's (triton
#2441's class; bitsandbytes PR 1691) raise, or read another device's memory and return
garbage; host code that caches device 0's properties (warp size, shared memory, number of
multiprocessors) picks another route or launch for device 1. Each check here runs the
same calls twice: with the tensors on the current device, and with them on the other
GPU while the current device is not theirs (``direction``). The second must stay on the
tensors' device, be within the float64 reference's bound, and equal the first bit for bit.

Quantize and dequantize take the weight's shape from the declared ``weight_shape`` axis;
the matmul, its backward and the layer's forward take the activation's rows from the
declared ``rows`` axis (every route change the backend claims, its neighbours, one row, a
decode batch, a prefill) on the weight every such route takes (``SMALL_BATCH_SHAPES``, the
route check's: Triton's rows kernel needs K a multiple of 256, which no ``weight_shape``
has), so every route a backend declares runs on the other device in some instance.
In CI each value of each axis is reached once, and each claimed format with each dtype
(the matrix's cells: ``qconform_ci_strength(1, jointly=...)``); all pairs of path values
are the single-device suites' job (the bugs here sit in a route's launch, not in a pair
of values), and 3-wise in ``thorough``.

Marked ``multi_gpu``: skipped with the reason on a machine with fewer than two GPUs, so a
single-device run never claims these cells.
"""

from __future__ import annotations

import pytest
import torch
from pytest_qconform.reference import bounds, linear

from pytest_qconform.cases.strategies import WeightCase

from ._cases import SMALL_BATCH_SHAPES, packed_dequantize_bound, reference_decode, require_claim, weight_error
from ._layers import activation, check_forward, layer_inputs, require_layer_claim, snapshot, snapshot_differences

# "data1-current0": the tensors on cuda:1 while cuda:0 is current; "data0-current1": the reverse.
DIRECTIONS = ("data1-current0", "data0-current1")
ROUTE_WEIGHT = SMALL_BATCH_SHAPES["cuda"]  # these checks run on GPUs only


def multi_device(operation: str, *path_axes: str):
    """The markers of a multi-device check: both directions, the spec's and the dtype's
    axes and ``path_axes`` (what selects the check's route), each value reached once in CI
    and each format with each dtype."""

    def mark(test):
        test = pytest.mark.multi_gpu(test)
        test = pytest.mark.parametrize("direction", DIRECTIONS)(test)
        test = pytest.mark.qconform_axes("format", "hqq_axis", "dtype", *path_axes)(test)
        test = pytest.mark.qconform_ci_strength(1, jointly=("format", "dtype"))(test)
        return pytest.mark.qconform_operation(f"multi-gpu:{operation}")(test)

    return mark


def placement(qtarget, direction: str) -> tuple[torch.device, int]:
    """(the tensors' device, the current device's index) of ``direction``; a skip with the
    reason where this machine has fewer than two GPUs."""
    if qtarget.kind == "cpu":
        pytest.skip("needs two GPUs: this run is on the CPU")
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs two GPUs; this machine has {count}")
    data, current = (1, 0) if direction == "data1-current0" else (0, 1)
    return torch.device("cuda", data), current


def _bias(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape[0], generator=torch.Generator().manual_seed(41)).to(dtype)


def _calls(qbackend, spec, dtype, shape, rows, device: torch.device, current: int, *, dequantize, backward) -> dict:
    """Quantize a ``shape`` weight, dequantize it, multiply ``rows`` rows (none: no matmul)
    with a bias and (``backward``: the backend claims it) run its backward, on ``device``
    while ``current`` is the current device; everything on the host afterwards."""
    with torch.cuda.device(current):
        weight = WeightCase(shape, "normal", 37).make(device)
        quantized = qbackend.quantize(weight, spec)
        out: dict = {"device": quantized.device, "packed": qbackend.export_packed(quantized)}
        if dequantize:
            w = qbackend.dequantize(quantized, dtype)
            out["dequantized"] = (w.device, w.cpu())
        if rows is not None:
            x = activation((rows,), shape[1], 43 + rows, dtype, device).requires_grad_(backward)
            y = qbackend.matmul(x, quantized, _bias(shape, dtype).to(device), dtype)
            if backward:
                y.backward(torch.ones_like(y))
            dx = x.grad.detach().cpu() if backward else None
            out["product"] = (x.detach().cpu(), y.device, y.detach().cpu(), dx)
        torch.cuda.synchronize(device)
    return out


def _home_and_away(
    qtarget, qbackend, spec, dtype, direction, shape, rows=None, *, backward: bool = False, dequantize: bool = False
):
    require_claim(qbackend, qtarget, spec, dtype, backward=backward, dequantize=dequantize)
    device, current = placement(qtarget, direction)
    calls = {"dequantize": dequantize, "backward": backward}
    home = _calls(qbackend, spec, dtype, shape, rows, device, device.index, **calls)
    away = _calls(qbackend, spec, dtype, shape, rows, device, current, **calls)
    return device, current, home, away


@multi_device("quantize", "weight_shape")
def test_quantize_on_another_device(qtarget, qbackend, qcheck, spec, dtype, weight_shape, direction):
    """The stored state made with the weight on another device than the current one: on
    the weight's device, and the same bytes and scales as with its device current."""
    device, current, home, away = _home_and_away(qtarget, qbackend, spec, dtype, direction, weight_shape)
    qcheck.describe(direction=direction, shape=weight_shape)
    qcheck.equal(away["device"], device, f"the quantized weight's device (current device cuda:{current})")
    changed = snapshot_differences(dict(vars(home["packed"])), dict(vars(away["packed"])))
    qcheck.equal(changed, [], f"stored fields that differ from the same quantization with {device} current")


@multi_device("dequantize", "weight_shape")
def test_dequantize_on_another_device(qtarget, qbackend, qcheck, spec, dtype, weight_shape, direction):
    """Dequantize with the state on another device than the current one: within the
    reference bound of its own bytes, and bit-equal to the call with its device current."""
    device, current, home, away = _home_and_away(
        qtarget, qbackend, spec, dtype, direction, weight_shape, dequantize=True
    )
    qcheck.describe(direction=direction, shape=weight_shape)
    out_device, out = away["dequantized"]
    qcheck.equal(out_device, device, f"dequantize's output device (current device cuda:{current})")
    w = reference_decode(away["packed"], torch.device("cpu"))
    qcheck.within(out, w, packed_dequantize_bound(away["packed"], w, dtype), "dequantize on another device")
    qcheck.equal(torch.equal(out, home["dequantized"][1]), True, f"bit-equal to the call with {device} current")


@multi_device("matmul", "rows")
def test_matmul_on_another_device(qtarget, qbackend, qcheck, spec, dtype, rows, direction):
    """``x W^T + b`` with the instance's rows on another device than the current one: within
    the reference bound, and bit-equal to the call with the tensors' device current."""
    device, current, home, away = _home_and_away(qtarget, qbackend, spec, dtype, direction, ROUTE_WEIGHT, rows)
    qcheck.describe(direction=direction, shape=ROUTE_WEIGHT, rows=rows)
    w = reference_decode(away["packed"], torch.device("cpu"))
    b = _bias(ROUTE_WEIGHT, dtype).double()
    x, y_device, y, _ = away["product"]
    qcheck.equal(y_device, device, f"the output's device (current device cuda:{current})")
    e_w = weight_error(away["packed"], w, dtype, rows=rows)
    qcheck.within(
        y,
        linear.linear(x.double(), w, b),
        bounds.matmul_bound(x.double(), w, b, dtype, dtype, w_error=e_w),
        f"{rows} rows on another device",
    )
    qcheck.equal(torch.equal(y, home["product"][2]), True, f"bit-equal to the call with {device} current")


@multi_device("backward", "rows")
def test_backward_on_another_device(qtarget, qbackend, qcheck, spec, dtype, rows, direction):
    """``dx = dy W`` on another device than the current one: within the reference bound,
    and bit-equal to the backward with the tensors' device current."""
    device, current, home, away = _home_and_away(
        qtarget, qbackend, spec, dtype, direction, ROUTE_WEIGHT, rows, backward=True
    )
    qcheck.describe(direction=direction, shape=ROUTE_WEIGHT, rows=rows)
    w = reference_decode(away["packed"], torch.device("cpu"))
    _, _, y, dx = away["product"]
    dy = torch.ones_like(y).double()
    e_w = weight_error(away["packed"], w, dtype, rows=rows)
    qcheck.within(dx, dy @ w, bounds.grad_bound(dy, w, dtype, dtype, w_error=e_w), f"{rows} rows: dx")
    qcheck.equal(torch.equal(dx, home["product"][3]), True, f"dx bit-equal to the call with {device} current")


@multi_device("layer-forward", "rows")
def test_layer_forward_on_another_device(qtarget, qbackend, qcheck, spec, dtype, rows, direction):
    """The backend's layer built on and called with another device than the current one
    (what ``device_map`` does to a model's second half): the same stored state, a forward
    of the instance's rows and ``dx`` within bound, bit-equal to the layer built and called
    with its device current; on the weight every route takes."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    device, current = placement(qtarget, direction)
    weight, bias = layer_inputs(53, dtype, ROUTE_WEIGHT)
    results = []
    for index in (device.index, current):
        with torch.cuda.device(index):
            layer = facet.quantize(weight, bias, spec, dtype, device)
            state = snapshot(facet, layer)
            x = activation((rows,), weight.shape[1], 59, dtype, device).requires_grad_(True)
            y = check_forward(qcheck, facet.packed(layer), layer, x, dtype, f"layer with cuda:{index} current")
            torch.cuda.synchronize(device)
            results.append((state, y.device, y.detach().cpu(), x.grad.detach().cpu()))
    (home_state, _, home_y, home_dx), (state, y_device, y, dx) = results
    qcheck.describe(direction=direction, shape=tuple(weight.shape), rows=rows)
    qcheck.equal(y_device, device, f"the layer's output device (current device cuda:{current})")
    qcheck.equal(snapshot_differences(home_state, state), [], "stored fields that differ from the layer built at home")
    qcheck.equal(torch.equal(y, home_y), True, f"forward bit-equal to the layer with {device} current")
    qcheck.equal(torch.equal(dx, home_dx), True, f"dx bit-equal to the layer with {device} current")


# Llama's modules over two GPUs as device_map="auto" splits a model too big for one: the
# embedding and the first decoder layer on the first device, the rest on the second.
def split_map(first: torch.device, second: torch.device) -> dict[str, str]:
    return {
        "model.embed_tokens": str(first),
        "model.rotary_emb": str(first),
        "model.layers.0": str(first),
        "model.layers.1": str(second),
        "model.norm": str(second),
        "lm_head": str(second),
    }


@pytest.mark.multi_gpu
@pytest.mark.qconform_axes("format", "hqq_axis", "dtype")
@pytest.mark.qconform_ci_strength(1)
@pytest.mark.qconform_operation("multi-gpu:split-model")
def test_split_model(qtarget, qbackend, qcheck, qwatch, tmp_path, spec, dtype):
    """The workload Llama split over two GPUs by a device map (``from_pretrained(device_map=)``
    where the backend claims transformers, else each layer quantized on its device and the
    rest dispatched by accelerate), cuda:0 current: a forward, greedy ``generate()`` and a
    QLoRA step (PEFT LoRA where the layer claims it), every sampled call of every quantized
    layer judged by the call-site oracle on the device it ran on."""
    facet, caps = require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    second, _ = placement(qtarget, "data1-current0")
    first = torch.device("cuda", 0)
    with torch.cuda.device(first):
        _split_model_workload(qbackend, qcheck, qwatch, tmp_path, spec, dtype, facet, caps, first, second)


def _split_model_workload(qbackend, qcheck, qwatch, tmp_path, spec, dtype, facet, caps, first, second) -> None:
    from ._layers import needs
    from ._workloads import prompts, quantized_model

    device_map = split_map(first, second)
    lm = quantized_model(qcheck, facet, caps, spec, "llama", dtype, first, tmp_path, device_map=device_map)
    devices = sorted({str(p.device) for p in lm.parameters()} | {str(b.device) for b in lm.buffers()})
    qcheck.equal(devices, sorted({str(first), str(second)}), "the devices the split model's tensors are on")
    ids, mask = prompts((5, 2, 7), seed=307, device=first)
    lm.eval()
    with qwatch(lm, {qbackend.name: facet}):
        with torch.no_grad():
            logits = lm(input_ids=ids, attention_mask=mask).logits
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    qcheck.equal(bool(torch.isfinite(logits).all()), True, "the split model's logits are finite")
    qcheck.equal(tuple(out.shape), (3, 10), "generate's output shape")
    if not caps.peft:
        return  # forward and generate only: PEFT does not wrap this layer class
    peft = needs("peft")
    lm = peft.prepare_model_for_kbit_training(lm, use_gradient_checkpointing=False)
    torch.manual_seed(401)
    targets = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if facet.owns(m)})
    lm = peft.get_peft_model(lm, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    lm.train()
    adapters = {name: p for name, p in lm.named_parameters() if p.requires_grad}
    with qwatch(lm, {qbackend.name: facet}):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not torch.float32):
            loss = lm(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
    missing = sorted(name for name, p in adapters.items() if p.grad is None or not bool(torch.isfinite(p.grad).all()))
    qcheck.equal(missing[:3], [], f"adapters without a finite gradient ({len(missing)} of {len(adapters)})")
    on = {str(p.device) for p in adapters.values()}
    qcheck.equal(sorted(on), sorted({str(first), str(second)}), "the devices the adapters are on")
