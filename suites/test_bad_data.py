"""Bad data gets a clear answer, and nothing is lost or hidden (issue 50, item 3).

Every other suite hands the backends data a healthy model holds. Real weights and batches
are not always healthy: a diverged fine-tune leaves NaN in a weight, a padded batch holds
a row of garbage, a download stops half way. Three truths from outside the layer, each on
every backend that claims the operation:

**Quantizing non-finite weights** (``nonfinite-quantize``). NaN, +inf and -inf at a few
elements of an otherwise normal weight, through the functional ``quantize``, the layer's
``quantize`` and transformers' ``from_pretrained`` of a float checkpoint (where the layer
claims transformers; where transformers refuses the config here, the layer's ``quantize``
of the weight loaded from that checkpoint). Either a clear error (its message says NaN, inf or non-finite) or
a stored state that decodes to a non-finite value at *every* non-finite input element,
both by the float64 reference from the backend's own bytes and by the backend's own
dequantize. A finite value there is a weight the user can no longer tell from a healthy
one: a failure naming the element, its input and what it decoded to.

The other elements. An element's quantization depends on the poison exactly when its
stored scale does: its block's absmax (bitsandbytes layout), its group's range (HQQ), and
with double quantization every block's, since the nested offset is the mean of all the
absmax. ``reference.faithful.faithful_bound``, computed from the input alone, is then NaN
or inf for that element, and it may decode to anything: spreading NaN through a block's
absmax is what the format's arithmetic does, and it flags the block rather than hiding
it. Every element whose bound is finite has a scale the poison did not touch, and must
decode within that bound of its input: poison must not travel past its own scale.

**Row isolation** (``row-isolation``). Each row of ``y = x W^T + b`` and of ``dx = dy W``
is a function of its own row of x (or dy) and the weight alone. A batch whose middle row
is NaN, inf, exactly the dtype's largest finite value, or that value divided by K
(products that overflow once summed) is compared with the same batch holding a normal
row there: the same row count, so the same route and kernel configuration (a backend may
change route by row count: ``Capabilities.dispatch_rows``; the ``rows`` axis runs each
declared route). The other rows must be *bit-equal* between the two calls, and within
their float64 bounds. Bit-equality is the criterion because a GEMM or GEMV kernel's
reduction order for output element (i, j) is fixed by the shapes and the kernel's
configuration, never by values, and no kernel reduces across rows: split-K adds partial
sums per output element, a tile of rows shares loads of W, not sums. A difference in
another row therefore means a value-dependent path across rows (a per-batch scale, a
shared max, a batch-wide NaN fallback): a bad sequence in a padded batch would cost the
others their answers. One row has no other row, so the ``rows`` axis starts at 2 here;
the one-row route's own results are the matmul suite's.

**Corrupt checkpoints** (``corrupt-checkpoint``). A quantized layer's state dict through
a safetensors file, with one of the tensors that hold the weight's data (the packed
codes and the per-block or per-group scales: every entry but the bias whose size doubles
with the weight's rows) missing, cut short (its last quarter of rows, as a download that
stopped), or another layer's (twice the rows), loaded the way the library's loaders do
(``LayerFacet.load``). Loading must raise an error that names the tensor: its key, or the
key's last part (a layer may report the name in its library's own state, ``packed`` for
the buffer ``quant_packed``). Loading without an error, or an error that names no tensor,
is a failure listing each corruption and what happened. The intact state must load.
"""

from __future__ import annotations

import re

import pytest
import torch
from pytest_qconform.reference import bounds, faithful, linear

from pytest_qconform.cases.strategies import WeightCase

from ._cases import SMALL_BATCH_SHAPES, reference_decode, require_claim, weight_error
from ._layers import LAYER_SHAPE, needs, require_layer_claim, tiny_llama

WEIGHT_SEED = 97
# (row, column, value) of the poisoned elements of a (64, 128) weight: three rows, three
# blocks of 64 and three HQQ groups on either axis, the last at the end of a row.
POISON: tuple[tuple[int, int, float], ...] = ((3, 5, float("nan")), (20, 70, float("inf")), (41, 127, float("-inf")))
# A refusal must say what is wrong with the weight.
NONFINITE_WORDS = re.compile(r"\b(nan|inf|infinite|infinity|non-?finite|not finite)\b", re.IGNORECASE)


def _poisoned(weight: torch.Tensor) -> torch.Tensor:
    weight = weight.clone()
    for row, col, value in POISON:
        weight[row, col] = value
    return weight


def _refusal_problem(exc: Exception, what: str) -> str | None:
    """None when ``exc`` is a clear refusal of a non-finite weight, else why it is not."""
    if NONFINITE_WORDS.search(str(exc)):
        return None
    return f"{what} raised an error that does not name the problem (NaN/inf): {type(exc).__name__}: {exc}"


def _check_poison_kept(qcheck, packed, weight: torch.Tensor, own: torch.Tensor | None, what: str) -> None:
    """The stored state decodes (reference, and the backend's own ``own``) to non-finite
    values at every poisoned element, and within the faithful bound wherever that bound,
    computed from the input alone, is finite (module docstring)."""
    decoded = reference_decode(packed, weight.device)
    hidden = []
    for row, col, value in POISON:
        got = float(decoded[row, col])
        if torch.isfinite(decoded[row, col]):
            hidden.append(f"element ({row}, {col}): input {value}, the reference decodes its stored bytes to {got!r}")
        if own is not None and torch.isfinite(own[row, col]):
            hidden.append(
                f"element ({row}, {col}): input {value}, the backend's dequantize gives {own[row, col].item()!r}"
            )
    qcheck.equal(hidden, [], f"{what}: non-finite inputs quantized to finite, normal-looking bytes")
    bound = faithful.faithful_bound(packed, weight).reshape(decoded.shape)
    clean = torch.isfinite(bound)
    qcheck.within(
        decoded[clean],
        weight.double().reshape(decoded.shape)[clean],
        bound[clean],
        f"{what}: the elements whose scale the poison did not touch, decoded against their input",
    )


@pytest.mark.qconform_operation("nonfinite-quantize")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype")  # the scale's arithmetic, not layout
def test_nonfinite_weights_are_refused_or_kept_nonfinite(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """NaN, +inf and -inf in a normal (64, 128) weight in ``dtype``, through the functional
    ``quantize`` and, where the backend offers a layer, the layer's ``quantize``."""
    caps = require_claim(qbackend, qtarget, spec, dtype)
    weight = _poisoned(WeightCase(LAYER_SHAPE, "normal", WEIGHT_SEED).make("cpu")).to(dtype)
    qcheck.describe(shape=LAYER_SHAPE, seed=WEIGHT_SEED, poison=[(r, c, str(v)) for r, c, v in POISON])
    try:
        quantized = qbackend.quantize(weight.to(qdevice), spec)
    except Exception as exc:  # noqa: BLE001 - a clear refusal is one of the two right answers
        qcheck.equal(_refusal_problem(exc, "quantize"), None, "quantize of a weight with NaN and inf")
    else:
        own = qbackend.dequantize(quantized, dtype).double() if caps.dequantize else None
        _check_poison_kept(qcheck, qbackend.export_packed(quantized), weight.to(qdevice), own, "quantize")
    facet = qbackend.layers()
    if facet is None:
        return
    try:
        layer = facet.quantize(weight, None, spec, dtype, qdevice)
    except Exception as exc:  # noqa: BLE001
        qcheck.equal(_refusal_problem(exc, "the layer's quantize"), None, "layer quantize of a weight with NaN and inf")
        return
    _check_poison_kept(qcheck, facet.computing_state(layer), weight.to(qdevice), None, "the layer's quantize")


@pytest.mark.qconform_operation("nonfinite-quantize")
@pytest.mark.qconform_axes(
    "format", "double_quant", "hqq_axis", "dtype", dtype=(torch.bfloat16, torch.float16)
)  # the model's path through transformers
def test_nonfinite_weights_through_from_pretrained(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, dtype):
    """A tiny Llama saved in ``dtype`` with NaN and inf in one MLP weight, quantized by
    ``from_pretrained`` with the backend's quantization config: refused clearly, or that
    layer's stored state keeps the poison (the loading path users take)."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype, transformers=True)
    transformers = needs("transformers")
    model = tiny_llama(dtype, WEIGHT_SEED)
    name = "model.layers.0.mlp.down_proj"  # (128, 256): every poisoned element is inside it
    target = dict(model.named_modules())[name]
    with torch.no_grad():
        target.weight.copy_(_poisoned(target.weight.float()).to(dtype))
    weight = target.weight.detach().clone()
    model.save_pretrained(tmp_path / "float")
    qcheck.describe(model="tiny Llama, 1 layer, hidden 128", seed=WEIGHT_SEED, layer=name)
    try:
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "float",
            quantization_config=facet.transformers_config(spec, dtype),
            device_map=str(qdevice),
            dtype=dtype,
        )
    except NotImplementedError as exc:
        # transformers does not quantize with this config here (HQQ on a CPU): the layer's
        # quantize of the weight as loaded from that checkpoint, as users then build the model.
        qcheck.describe(built_by="the layer's quantize of the loaded weight", transformers_refused=str(exc)[:80])
        loaded = needs("safetensors.torch").load_file(str(tmp_path / "float" / "model.safetensors"))
        weight = loaded[f"{name}.weight"]
        try:
            layer = facet.quantize(weight, None, spec, dtype, qdevice)
        except Exception as exc:  # noqa: BLE001
            qcheck.equal(_refusal_problem(exc, "the layer's quantize"), None, "quantize of a loaded weight with NaN")
            return
    except Exception as exc:  # noqa: BLE001
        qcheck.equal(_refusal_problem(exc, "from_pretrained"), None, "from_pretrained of a weight with NaN and inf")
        return
    else:
        layer = dict(quantized.named_modules())[name]
    qcheck.equal(isinstance(layer, facet.layer_types()), True, f"transformers replaced {name} with the backend's layer")
    _check_poison_kept(qcheck, facet.computing_state(layer), weight.to(qdevice), None, f"from_pretrained, {name}")


# The bad row's contents: one NaN, one +inf, every element at the dtype's largest finite
# value (alternating signs), and every element at that value / K (a sum that overflows).
# An instance runs one non-finite row and one huge row: ``nan`` and ``max`` at an even row
# count, ``inf`` and ``max/K`` at an odd one, so each declared route (a row count and its
# neighbours) meets all four, at half the calls (our kernels run in Triton's interpreter on
# a CPU: about 0.3 s a call). The contents select no path: a kernel must not look at them.
BAD_ROWS = ("nan", "inf", "max", "max/K")


def _bad_row(kind: str, normal: torch.Tensor) -> torch.Tensor:
    big = torch.finfo(normal.dtype).max
    k = normal.shape[-1]
    if kind == "nan":
        return normal.clone().index_fill_(0, torch.tensor([k // 3]), float("nan"))
    if kind == "inf":
        return normal.clone().index_fill_(0, torch.tensor([k // 3]), float("inf"))
    if kind == "max":
        signs = torch.ones(k, dtype=normal.dtype).index_fill_(0, torch.arange(1, k, 2), -1.0)
        return signs * big
    return torch.full_like(normal, big / k)


def _first_difference(got: torch.Tensor, want: torch.Tensor, rows: list[int]) -> str | None:
    """Where ``got`` and ``want`` differ in their bits on ``rows``, or None."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    a = got[rows].contiguous().view(bits)
    b = want[rows].contiguous().view(bits)
    if torch.equal(a, b):
        return None
    where = torch.nonzero(a != b)[0].tolist()
    row, col = rows[where[0]], where[1]
    count = int((a != b).sum())
    return f"row {row}, column {col}: {got[row, col].item()!r} != {want[row, col].item()!r} ({count} elements differ)"


@pytest.mark.qconform_operation("row-isolation")
@pytest.mark.qconform_axes(
    "format", "double_quant", "hqq_axis", "dtype", "rows", rows=tuple(range(2, 4097))
)  # every declared route of two rows and more
def test_a_bad_row_changes_only_its_own_outputs(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows):
    """A batch of ``rows`` rows whose middle row is bad (``BAD_ROWS``), forward with a
    bias and, where claimed, ``dx = dy W`` with the bad row in dy: every other row bit-equal
    to the call with a normal row there, and within its float64 bound."""
    caps = require_claim(qbackend, qtarget, spec, dtype)
    n, k = SMALL_BATCH_SHAPES.get(qdevice.type, SMALL_BATCH_SHAPES["cpu"])
    quantized = qbackend.quantize(WeightCase((n, k), "normal", seed=WEIGHT_SEED).make(qdevice), spec)
    packed = qbackend.export_packed(quantized)
    w = reference_decode(packed, qdevice)
    w_error = weight_error(packed, w, dtype, rows=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype).to(qdevice)
    bad, others = rows // 2, [r for r in range(rows) if r != rows // 2]
    qcheck.describe(shape=(n, k), seed=WEIGHT_SEED, rows=rows, bad_row=bad)

    x_ok = x.to(qdevice).requires_grad_(caps.backward)
    y_ok = qbackend.matmul(x_ok, quantized, bias, dtype)
    exact = linear.linear(x_ok.detach().double(), w, bias.double())
    bound = bounds.matmul_bound(x_ok.detach().double(), w, bias.double(), dtype, dtype, w_error=w_error)
    qcheck.within(y_ok.detach()[others], exact[others], bound[others], "forward, the batch with a normal row")
    if caps.backward:
        (dx_ok,) = torch.autograd.grad(y_ok, x_ok, dy.to(qdevice), retain_graph=True)
        dx_exact = dy.double().to(qdevice) @ w
        dx_bound = bounds.grad_bound(dy.double().to(qdevice), w, dtype, dtype, w_error=w_error)
    for kind in BAD_ROWS[rows % 2 :: 2]:
        qcheck.describe(bad_row_holds=kind)
        x_bad = x.clone()
        x_bad[bad] = _bad_row(kind, x[bad])
        y_bad = qbackend.matmul(x_bad.to(qdevice), quantized, bias, dtype).detach()
        difference = _first_difference(y_bad, y_ok.detach(), others)
        qcheck.equal(difference, None, f"forward: row {bad} holding {kind} changed another row's output")
        qcheck.within(y_bad[others], exact[others], bound[others], f"forward, the other rows beside a {kind} row")
        if not caps.backward:
            continue
        dy_bad = dy.clone()
        dy_bad[bad] = _bad_row(kind, dy[bad])
        (dx_bad,) = torch.autograd.grad(y_ok, x_ok, dy_bad.to(qdevice), retain_graph=True)
        difference = _first_difference(dx_bad, dx_ok, others)
        qcheck.equal(difference, None, f"backward dx = dy W: dy's row {bad} holding {kind} changed another row of dx")
        qcheck.within(
            dx_bad[others],
            dx_exact[others],
            dx_bound[others],
            f"backward dx = dy W, the other rows beside a {kind} row",
        )


# -- corrupt checkpoints ------------------------------------------------------------------------

CORRUPTIONS = ("missing", "cut short", "another layer's")


def _corrupted(state: dict[str, torch.Tensor], key: str, corruption: str) -> dict[str, torch.Tensor]:
    state = dict(state)
    tensor = state[key]
    if corruption == "missing":
        del state[key]
    elif corruption == "cut short":  # its last quarter of rows (1-D: of elements) lost
        state[key] = tensor[: tensor.shape[0] - max(1, tensor.shape[0] // 4)].clone()
    else:  # the same entry of a layer with twice the rows
        state[key] = torch.cat([tensor, tensor]).contiguous()
    return state


def _names(message: str, key: str) -> bool:
    """Whether ``message`` names the tensor ``key``: the key, or the key's last dotted
    part, or that part after a prefix of the layer's (``quant_packed`` -> ``packed``),
    as a whole word (module docstring)."""
    last = key.rsplit(".", 1)[-1]
    names = {key, last} | {last.split("_", i)[-1] for i in range(1, last.count("_") + 1)}
    return any(re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message) for name in names if len(name) >= 3)


@pytest.mark.qconform_operation("corrupt-checkpoint")
@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis")  # which tensors the state holds
def test_corrupt_checkpoint_raises_naming_the_tensor(qtarget, qbackend, qdevice, qcheck, tmp_path, spec):
    """A layer's state dict through a safetensors file, each tensor holding the weight's
    data missing, cut short or another layer's, loaded into a fresh layer by the library's
    loader (``LayerFacet.load``): an error naming that tensor each time."""
    dtype = torch.bfloat16 if qtarget.bf16 else torch.float16
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype)
    safetensors_torch = needs("safetensors.torch")
    weight = WeightCase(LAYER_SHAPE, "normal", WEIGHT_SEED).make("cpu").to(dtype)
    bias = torch.randn(LAYER_SHAPE[0], generator=torch.Generator().manual_seed(WEIGHT_SEED)).to(dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice)
    state = {key: value.detach().contiguous() for key, value in layer.state_dict().items()}
    taller = facet.quantize(torch.cat([weight, weight]), torch.cat([bias, bias]), spec, dtype, qdevice).state_dict()
    data = sorted(
        key
        for key, value in state.items()
        if key != "bias" and key in taller and taller[key].numel() == 2 * value.numel()
    )
    qcheck.describe(shape=LAYER_SHAPE, seed=WEIGHT_SEED, data_tensors=data)
    qcheck.equal(len(data) >= 2, True, f"the state dict holds the weight's bytes and scales (keys: {sorted(state)})")

    def load(saved: dict[str, torch.Tensor], name: str):
        path = tmp_path / f"{name}.safetensors"
        safetensors_torch.save_file(saved, str(path))
        empty = facet.empty(spec, LAYER_SHAPE, True, dtype)
        return facet.load(empty, safetensors_torch.load_file(str(path)), qdevice)

    load(state, "intact")  # the intact checkpoint loads (an error here is the test's failure)
    problems = []
    for key in data:
        for corruption in CORRUPTIONS:
            try:
                load(_corrupted(state, key, corruption), f"corrupt-{len(problems)}")
            except Exception as exc:  # noqa: BLE001 - refusing is the right answer, if it says what
                if not _names(str(exc), key):
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    problems.append(f"{key} {corruption}: {type(exc).__name__} naming no tensor: {first[:200]}")
            else:
                problems.append(f"{key} {corruption}: loaded without an error")
    qcheck.equal(problems, [], "corrupt checkpoints that did not raise an error naming the tensor")
