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

Marked ``multi_gpu``: skipped with the reason on a machine with fewer than two GPUs, so a
single-device run never claims these cells.
"""

from __future__ import annotations

import pytest
import torch
from pytest_qconform.reference import bounds, linear

from pytest_qconform.cases.strategies import WeightCase

from ._cases import packed_dequantize_bound, reference_decode, require_claim, weight_error
from ._layers import activation, check_forward, layer_inputs, require_layer_claim, snapshot, snapshot_differences

# "data1-current0": the tensors on cuda:1 while cuda:0 is current; "data0-current1": the reverse.
DIRECTIONS = ("data1-current0", "data0-current1")
SHAPE = (256, 512)  # K a multiple of 256: the rows our fused kernels take
ROWS = (1, 3, 16)  # a gemv, a few-row kernel, a GEMM: the routes a backend declares meet here


def multi_device(operation: str):
    def mark(test):
        test = pytest.mark.multi_gpu(test)
        test = pytest.mark.parametrize("direction", DIRECTIONS)(test)
        test = pytest.mark.qconform_axes("format", "hqq_axis", "dtype")(test)
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


def _calls(qbackend, spec, dtype, device: torch.device, current: int, *, dequantize: bool, backward: bool) -> dict:
    """Quantize, dequantize, a matmul of each of ``ROWS`` with a bias and (``backward``: the
    backend claims it) its backward, on ``device`` while ``current`` is the current device;
    everything on the host afterwards."""
    with torch.cuda.device(current):
        weight = WeightCase(SHAPE, "normal", 37).make(device)
        quantized = qbackend.quantize(weight, spec)
        out: dict = {"device": quantized.device, "packed": qbackend.export_packed(quantized)}
        if dequantize:
            w = qbackend.dequantize(quantized, dtype)
            out["dequantized"] = (w.device, w.cpu())
        bias = torch.randn(SHAPE[0], generator=torch.Generator().manual_seed(41)).to(dtype).to(device)
        for rows in ROWS:
            x = activation((rows,), SHAPE[1], 43 + rows, dtype, device).requires_grad_(backward)
            y = qbackend.matmul(x, quantized, bias, dtype)
            if backward:
                y.backward(torch.ones_like(y))
            dx = x.grad.detach().cpu() if backward else None
            out[rows] = (x.detach().cpu(), y.device, y.detach().cpu(), dx)
        torch.cuda.synchronize(device)
    return out


def _home_and_away(qtarget, qbackend, spec, dtype, direction, *, backward: bool = False, dequantize: bool = False):
    require_claim(qbackend, qtarget, spec, dtype, backward=backward, dequantize=dequantize)
    device, current = placement(qtarget, direction)
    home = _calls(qbackend, spec, dtype, device, device.index, dequantize=dequantize, backward=backward)
    away = _calls(qbackend, spec, dtype, device, current, dequantize=dequantize, backward=backward)
    return device, current, home, away


@multi_device("quantize")
def test_quantize_on_another_device(qtarget, qbackend, qcheck, spec, dtype, direction):
    """The stored state made with the weight on another device than the current one: on
    the weight's device, and the same bytes and scales as with its device current."""
    device, current, home, away = _home_and_away(qtarget, qbackend, spec, dtype, direction)
    qcheck.describe(direction=direction, shape=SHAPE)
    qcheck.equal(away["device"], device, f"the quantized weight's device (current device cuda:{current})")
    fields = {k: v for k, v in vars(home["packed"]).items()}
    changed = snapshot_differences(fields, dict(vars(away["packed"])))
    qcheck.equal(changed, [], f"stored fields that differ from the same quantization with {device} current")


@multi_device("dequantize")
def test_dequantize_on_another_device(qtarget, qbackend, qcheck, spec, dtype, direction):
    """Dequantize with the state on another device than the current one: within the
    reference bound of its own bytes, and bit-equal to the call with its device current."""
    device, current, home, away = _home_and_away(qtarget, qbackend, spec, dtype, direction, dequantize=True)
    qcheck.describe(direction=direction, shape=SHAPE)
    out_device, out = away["dequantized"]
    qcheck.equal(out_device, device, f"dequantize's output device (current device cuda:{current})")
    w = reference_decode(away["packed"], torch.device("cpu"))
    qcheck.within(out, w, packed_dequantize_bound(away["packed"], w, dtype), "dequantize on another device")
    qcheck.equal(torch.equal(out, home["dequantized"][1]), True, f"bit-equal to the call with {device} current")


@multi_device("matmul")
def test_matmul_on_another_device(qtarget, qbackend, qcheck, spec, dtype, direction):
    """``x W^T + b`` with 1, 3 and 16 rows on another device than the current one: within
    the reference bound, and bit-equal to the call with the tensors' device current."""
    device, current, home, away = _home_and_away(qtarget, qbackend, spec, dtype, direction)
    qcheck.describe(direction=direction, shape=SHAPE)
    w = reference_decode(away["packed"], torch.device("cpu"))
    b = torch.randn(SHAPE[0], generator=torch.Generator().manual_seed(41)).to(dtype).double()
    for rows in ROWS:
        x, y_device, y, _ = away[rows]
        qcheck.equal(y_device, device, f"{rows} rows: the output's device (current device cuda:{current})")
        e_w = weight_error(away["packed"], w, dtype, rows=rows)
        qcheck.within(
            y,
            linear.linear(x.double(), w, b),
            bounds.matmul_bound(x.double(), w, b, dtype, dtype, w_error=e_w),
            f"{rows} rows on another device",
        )
        qcheck.equal(torch.equal(y, home[rows][2]), True, f"{rows} rows: bit-equal to the call with {device} current")


@multi_device("backward")
def test_backward_on_another_device(qtarget, qbackend, qcheck, spec, dtype, direction):
    """``dx = dy W`` on another device than the current one: within the reference bound,
    and bit-equal to the backward with the tensors' device current."""
    device, current, home, away = _home_and_away(qtarget, qbackend, spec, dtype, direction, backward=True)
    qcheck.describe(direction=direction, shape=SHAPE)
    w = reference_decode(away["packed"], torch.device("cpu"))
    for rows in ROWS:
        _, _, y, dx = away[rows]
        dy = torch.ones_like(y).double()
        e_w = weight_error(away["packed"], w, dtype, rows=rows)
        qcheck.within(dx, dy @ w, bounds.grad_bound(dy, w, dtype, dtype, w_error=e_w), f"{rows} rows: dx")
        qcheck.equal(
            torch.equal(dx, home[rows][3]), True, f"{rows} rows: dx bit-equal to the call with {device} current"
        )


@multi_device("layer-forward")
def test_layer_forward_on_another_device(qtarget, qbackend, qcheck, spec, dtype, direction):
    """The backend's layer built on and called with another device than the current one
    (what ``device_map`` does to a model's second half): the same stored state, a forward
    and ``dx`` within bound, bit-equal to the layer built and called with its device current."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    device, current = placement(qtarget, direction)
    weight, bias = layer_inputs(53, dtype)
    results = []
    for index in (device.index, current):
        with torch.cuda.device(index):
            layer = facet.quantize(weight, bias, spec, dtype, device)
            state = snapshot(facet, layer)
            x = activation((3,), weight.shape[1], 59, dtype, device).requires_grad_(True)
            y = check_forward(qcheck, facet.packed(layer), layer, x, dtype, f"layer with cuda:{index} current")
            torch.cuda.synchronize(device)
            results.append((state, y.device, y.detach().cpu(), x.grad.detach().cpu()))
    (home_state, _, home_y, home_dx), (state, y_device, y, dx) = results
    qcheck.describe(direction=direction, shape=tuple(weight.shape))
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
