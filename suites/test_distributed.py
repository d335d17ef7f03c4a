"""QLoRA across processes: a training step on two ranks under DDP, under torch's FSDP2 and
under FSDP as accelerate's plugin sets it up (``_distributed``), gloo on the CPU, NCCL on
two GPUs (accelerate's FSDP on GPUs only); LoRA through PEFT where the layer claims it,
else PEFT's arithmetic around the layer (``_distributed.LoraLinear``).

What must hold afterwards, per mode: every rank's packed bytes and the rest of its
quantization state are those rank 0 loaded (a hash of each, per layer: under FSDP, the
other ranks started from other weights and got rank 0's state through its broadcast, so a
state outside parameters and buffers shows here); the reduced LoRA gradient is the same on
every rank and within bound of the float64 shadow of the single-process step over both
ranks' micro-batches (each rank's calls, from the layer's own bytes, averaged: one more
rounding for the reduction's sum); AdamW's update follows from it.

Opt-in (``-m distributed``): spawning two ranks that import transformers and PEFT costs
about 20 s on the 2-core CI machine, which runs it as a step of its own (``.ci/run``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pytest_qconform.reference import bounds

from pytest_qconform.session.outcomes import skip_other_device

from ._distributed import ACCELERATE_MODES, EPS, LR, MODES, WORLD, StepSetup, backend_ref, run_ranks
from ._layers import needs, require_layer_claim
from ._workloads import check_first_adamw_step

# One spawn per backend, quantization, device and group of modes (torch's wrappers; accelerate's)
# runs the group; each mode's test reads its part.
STEPS = pytest.StashKey[dict]()


def distributed(mode: str):
    """The markers of a distributed check: opt-in, its operation, one instance per backend
    (NF4 or HQQ's 4-bit, bf16: the QLoRA recipe)."""

    def mark(test):
        test = pytest.mark.distributed(test)
        test = pytest.mark.qconform_axes(
            "format", "hqq_axis", "dtype", format=("nf4", "hqq4"), hqq_axis=(1,), dtype=(torch.bfloat16,)
        )(test)
        test = pytest.mark.qconform_ci_strength(1)(test)
        return pytest.mark.qconform_operation(f"distributed:{mode}")(test)

    return mark


def _results(request, qtarget, qbackend, spec, dtype, tmp_path_factory, modes=MODES) -> list[dict]:
    needs("peft")
    needs("transformers")
    if qtarget.kind != "cpu" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs for {WORLD} NCCL ranks; this machine has {torch.cuda.device_count()}")
    if qtarget.kind != "cpu" and not torch.distributed.is_nccl_available():
        pytest.skip("needs NCCL, which this torch build lacks")
    if qtarget.kind == "cpu" and not torch.distributed.is_gloo_available():
        pytest.skip("needs gloo, which this torch build lacks")
    setup = StepSetup(
        backend_ref(qbackend.unchecked),
        spec,
        dtype,
        "cpu" if qtarget.kind == "cpu" else "cuda",
        str(tmp_path_factory.mktemp("ranks")),
        modes,
    )
    cache = request.config.stash.setdefault(STEPS, {})
    key = (qbackend.name, spec, dtype, setup.device_kind, modes)
    if key not in cache:
        cache[key] = run_ranks(setup)
    return cache[key]


def _check_step(qcheck, results: list[dict], mode: str, *, same_checkpoint: bool) -> None:
    errors = [f"rank {rank}:\n{r[mode]['error']}" for rank, r in enumerate(results) if "error" in r[mode]]
    if errors:
        raise AssertionError(f"the {mode} step raised on {len(errors)} of {WORLD} ranks:\n" + "\n".join(errors))
    steps = [r[mode] for r in results]
    reference = steps[0]["loaded"]
    qcheck.describe(ranks=WORLD, layers=len(reference), adapters=len(steps[0]["adapters"]))
    for rank, step in enumerate(steps):
        checkpoints = [("as loaded", step["loaded"])] if same_checkpoint else []
        for when, hashes in [*checkpoints, ("after the step", step["after"])]:
            qcheck.equal(sorted(hashes), sorted(reference), f"rank {rank}: the quantized layers {when}")
            for layer, (codes, state) in reference.items():
                qcheck.equal(hashes[layer][0], codes, f"rank {rank}: {layer}'s packed bytes {when} (against rank 0's)")
                qcheck.equal(
                    hashes[layer][1], state, f"rank {rank}: {layer}'s quantization state {when} (against rank 0's)"
                )
    first = steps[0]
    for name in first["adapters"]:
        grads = [step["gradients"].get(name) for step in steps]
        qcheck.equal([g is None for g in grads], [False] * WORLD, f"{name}: a gradient on every rank")
        same = all(torch.equal(g, grads[0]) for g in grads)
        qcheck.equal(same, True, f"{name}: the reduced gradient is the same on every rank")
        exact = sum(step["shadows"][f"{name}:exact"] for step in steps) / WORLD
        bound = sum(step["shadows"][f"{name}:bound"] for step in steps) / WORLD
        bound = bound + bounds.rounding_bound(exact.abs() + bound, grads[0].dtype)  # the reduction's sum
        qcheck.within(grads[0], exact, bound, f"{name}: the gradient averaged over the ranks against float64")
    for rank, step in enumerate(steps):
        before = {name: (step["before"][name], step["gradients"][name].double()) for name in first["adapters"]}
        updated = {f"rank {rank}: {name}": step["updated"][name] for name in first["adapters"]}
        check_first_adamw_step(
            qcheck, updated, {f"rank {rank}: {name}": before[name] for name in first["adapters"]}, LR, EPS
        )


def _storage_spec(qbackend, qtarget, spec, dtype):
    """The spec with the packed bytes stored as the compute dtype where the backend claims
    that (FSDP-QLoRA's ``bnb_4bit_quant_storage``), else as the backend stores them."""
    caps = qbackend.capabilities(torch.device(qtarget.torch_device or "cpu"))
    return dataclasses.replace(spec, quant_storage=dtype) if dtype in caps.quant_storages else spec


@distributed("ddp")
def test_ddp_qlora_step(request, qtarget, qbackend, qcheck, tmp_path_factory, spec, dtype):
    """DDP: every rank loads the checkpoint, one micro-batch each, gradients all-reduced."""
    spec = _storage_spec(qbackend, qtarget, spec, dtype)
    require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    results = _results(request, qtarget, qbackend, spec, dtype, tmp_path_factory)
    _check_step(qcheck, results, "ddp", same_checkpoint=True)


@distributed("fsdp")
def test_fsdp_qlora_step(request, qtarget, qbackend, qcheck, tmp_path_factory, spec, dtype):
    """FSDP: the model sharded per decoder layer, rank 0's checkpoint broadcast to ranks
    that started from other weights, one micro-batch each, gradients reduce-scattered."""
    spec = _storage_spec(qbackend, qtarget, spec, dtype)
    require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    results = _results(request, qtarget, qbackend, spec, dtype, tmp_path_factory)
    _check_step(qcheck, results, "fsdp", same_checkpoint=False)


@distributed("fsdp-accelerate")
def test_fsdp_accelerate_qlora_step(request, qtarget, qbackend, qcheck, tmp_path_factory, spec, dtype):
    """FSDP as accelerate sets it up (``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
    fsdp_version=2, transformer-layer wrapping, cpu_ram_efficient_loading))``,
    ``accelerator.prepare(model, optimizer)``): every rank loads the checkpoint, one
    micro-batch each. GPUs only: accelerate 1.15 runs an FSDP plugin on CPU ranks as DDP."""
    spec = _storage_spec(qbackend, qtarget, spec, dtype)
    require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    if qtarget.kind == "cpu":  # no cell on a CPU run, as a CUDA graph's: this device cannot compute it
        skip_other_device(
            "accelerate runs an fsdp_plugin on CPU ranks as DDP (DistributedType.MULTI_CPU: its state sets FSDP "
            "for accelerator ranks only); the fsdp cell runs torch's FSDP2 on the CPU"
        )
    needs("accelerate")
    results = _results(request, qtarget, qbackend, spec, dtype, tmp_path_factory, ACCELERATE_MODES)
    _check_step(qcheck, results, "fsdp-accelerate", same_checkpoint=True)
