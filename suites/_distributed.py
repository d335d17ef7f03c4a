"""A QLoRA training step on two ranks (``test_distributed.py``): what each rank runs and
what it hands back.

The test spawns the ranks (``torch.multiprocessing``, a fresh interpreter each: a forked
child would inherit the pytest process' thread pools) with gloo on the CPU, NCCL on GPUs
(rank ``r`` on ``cuda:r``). Each rank builds the workload suite's Llama from the same
checkpoint (``_workloads.quantized_model``), quantized by the backend with the packed bytes
stored as the compute dtype (``quant_storage``, what FSDP-QLoRA requires), puts LoRA on
every quantized layer, wraps the model and runs one step on a micro-batch of its own:

- ``ddp``: ``DistributedDataParallel``, every rank loading the checkpoint, as DDP users run;
- ``fsdp``: torch's FSDP (``fully_shard`` on each decoder layer, then the model, as
  accelerate's FSDP2 wraps a transformers model); rank 0 loads the checkpoint and the others
  start from other weights, which rank 0's full state dict then replaces through the rank-0
  broadcast (``set_model_state_dict(broadcast_from_rank0=True)``, accelerate's
  ``cpu_ram_efficient_loading``). A quantization state that is neither a parameter nor a
  buffer stays as the other weights left it;
- ``fsdp-accelerate``: FSDP as users get it, accelerate's ``FullyShardedDataParallelPlugin``
  with the FSDP-QLoRA guides' settings and ``accelerator.prepare(model, optimizer)``, every
  rank loading the checkpoint as ``from_pretrained`` loads a quantized model on each; on
  GPUs only (accelerate runs an FSDP plugin on CPU ranks as DDP).

Each rank returns, per mode, a hash of its packed bytes and one of the rest of its
quantization state (after loading, and after the step), each LoRA parameter's gradient
(after the wrapper's reduction), its value before and after AdamW's step, and the float64
shadow of its own contribution to that gradient (``_workloads.accumulated_lora_gradients``
over the calls the rank's layers received, from the layer's own bytes).
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import hashlib
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pytest_qconform.backends.base import Backend, QuantSpec

WORLD = 2
MODES: tuple[str, ...] = ("ddp", "fsdp")  # torch's wrappers, one spawn
# FSDP through accelerate's plugin, a spawn of its own (accelerate's state lives for the
# process). GPUs only: accelerate 1.15 turns an fsdp_plugin into DDP on CPU ranks
# (DistributedType.MULTI_CPU; state.py sets FSDP for accelerator ranks only).
ACCELERATE_MODES: tuple[str, ...] = ("fsdp-accelerate",)
COLLECTIVE_TIMEOUT = 120  # seconds an NCCL collective waits for a peer that left (gloo sees it leave)
RANK, ALPHA = 4, 8
LR, EPS = 1e-3, 1e-8
RANK_TIMEOUT = 420  # seconds: a rank under load (the zoo runs suites side by side) takes minutes, not ten
SEED, OTHER_WEIGHTS_SEED = 211, 977  # the checkpoint's weights; what the other ranks start from before the broadcast


@dataclass(frozen=True)
class StepSetup:
    """What every rank needs, picklable: the backend (its class, or its registered name),
    the quantization, the compute dtype, the device kind and a folder of its own."""

    backend: type[Backend] | str
    spec: QuantSpec
    dtype: torch.dtype
    device_kind: str  # "cpu" (gloo) or "cuda" (NCCL)
    folder: str
    modes: tuple[str, ...] = MODES


def backend_ref(backend: Backend) -> type[Backend] | str:
    """How a spawned rank rebuilds ``backend``: the nearest class of its MRO that pickles by
    reference (a module-level class) and has its name (a subclass made at run time to narrow
    its claims computes what its base does), else its registered name."""
    import pickle

    for cls in type(backend).__mro__:
        if getattr(cls, "name", None) != backend.name:
            continue
        try:
            pickle.dumps(cls)
            return cls
        except (pickle.PicklingError, AttributeError, TypeError):
            continue
    return backend.name


def run_ranks(setup: StepSetup, timeout: float = RANK_TIMEOUT + 30) -> list[dict[str, Any]]:
    """Spawn ``WORLD`` ranks of ``rank_main``; their results, by rank. A rank that raises
    records the traceback in its mode and leaves the group (its peers' next collective
    fails rather than waits); ranks still running at ``timeout`` are ended."""
    import torch.multiprocessing as mp

    context = mp.start_processes(rank_main, args=(setup,), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    for process in context.processes:
        process.join(max(deadline - time.monotonic(), 0.1))
    late = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
    for rank in late:
        context.processes[rank].terminate()
    results = []
    for rank, process in enumerate(context.processes):
        path = Path(setup.folder) / f"rank{rank}.pt"
        if path.exists():
            results.append(torch.load(path, weights_only=True))
            continue
        why = f"still running after {timeout:.0f} s" if rank in late else f"exit code {process.exitcode}"
        results.append({mode: {"error": f"rank {rank} wrote no result ({why})"} for mode in setup.modes})
    return results


def rank_main(rank: int, setup: StepSetup) -> None:
    """One rank: join the group, run each mode's step, write the results. After a mode
    raises, the rank writes what it has and leaves without another collective."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(RANK_TIMEOUT, exit=True)  # a rank stuck in a collective ends, saying where
    if setup.device_kind == "cuda":
        torch.cuda.set_device(rank)
    # Built before joining the group: transformers saves a checkpoint on rank 0 only once there is one.
    models: dict[str, Any] = {}
    for mode in setup.modes:
        try:
            models[mode] = _build(rank, setup, mode)
        except Exception:  # noqa: BLE001 - reported in the mode's cell, after joining (the peers then see this rank leave)
            models[mode] = traceback.format_exc(limit=-6)
    dist.init_process_group(
        "nccl" if setup.device_kind == "cuda" else "gloo",
        init_method=f"file://{Path(setup.folder) / 'rendezvous'}",
        rank=rank,
        world_size=WORLD,
        **({"timeout": datetime.timedelta(seconds=COLLECTIVE_TIMEOUT)} if setup.device_kind == "cuda" else {}),
    )
    results: dict[str, Any] = {mode: {"error": f"rank {rank} did not reach the {mode} step"} for mode in setup.modes}
    failed = False
    for mode in setup.modes:
        try:
            if isinstance(models[mode], str):
                raise RuntimeError(f"building the model failed:\n{models[mode]}")
            results[mode] = _step(rank, setup, mode, *models[mode])
            dist.barrier()
        except Exception:  # noqa: BLE001 - reported in the mode's cell
            results[mode] = {"error": traceback.format_exc(limit=-6)}
            failed = True
            break
    torch.save(results, Path(setup.folder) / f"rank{rank}.pt")
    if failed:
        os._exit(1)  # no destroy_process_group: it would wait for peers in a collective
    dist.destroy_process_group()


class _Quiet:
    """``quantized_model``'s ``qcheck``: a rank describes nothing."""

    def describe(self, **context: Any) -> None:
        return None


def _backend(setup: StepSetup) -> Backend:
    if isinstance(setup.backend, str):
        from pytest_qconform.backends import registry

        return registry.create(setup.backend)
    return setup.backend()


def state_hashes(packed: Any) -> tuple[str, str]:
    """(hash of the packed bytes, hash of every other field of the state) of a packed record."""
    codes, rest = hashlib.sha256(), hashlib.sha256()
    for field in dataclasses.fields(packed):
        value = getattr(packed, field.name)
        target = codes if field.name == "packed" else rest
        target.update(field.name.encode())
        if isinstance(value, np.ndarray):
            target.update(np.ascontiguousarray(value).tobytes())
            target.update(str(value.dtype).encode())
        else:
            target.update(repr(value).encode())
    return codes.hexdigest(), rest.hexdigest()


def _model_hashes(model: torch.nn.Module, facet: Any) -> dict[str, list[str]]:
    return {
        name.removeprefix("base_model.model.").removesuffix(".base_layer"): list(state_hashes(facet.packed(m)))
        for name, m in model.named_modules()
        if facet.owns(m)
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (FSDP's ``DTensor``) gathered; any other as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class LoraLinear(torch.nn.Module):
    """LoRA around a quantized layer PEFT does not know (a ``FunctionalLinear``), with PEFT's
    arithmetic and names: ``y = base(x) + s B(A(x))``, the adapters in float32 and ``x``
    cast to their dtype, as PEFT's ``lora.Linear`` computes it."""

    def __init__(self, base: torch.nn.Module, in_features: int, out_features: int) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(in_features, RANK, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(RANK, out_features, bias=False)})
        torch.nn.init.normal_(self.lora_B["default"].weight, std=0.02)  # PEFT's init_lora_weights=False: nonzero B
        self.scaling = ALPHA / RANK

    def get_base_layer(self) -> torch.nn.Module:
        return self.base_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        a, b = self.lora_A["default"], self.lora_B["default"]
        return (y + b(a(x.to(a.weight.dtype))) * self.scaling).to(y.dtype)


def with_lora(model: torch.nn.Module, facet: Any, device: torch.device) -> torch.nn.Module:
    """``model`` with ``LoraLinear`` around each of the backend's quantized layers, its
    adapters on ``device`` (a layer's buffers are no guide: a state may keep scalars on the host)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if facet.owns(child):
                out_features, in_features = facet.packed(child).shape
                lora = LoraLinear(child, in_features, out_features)
                lora.lora_A.to(device)
                lora.lora_B.to(device)  # the quantized layer stays as it was built
                setattr(module, name, lora)
    return model


def _device(rank: int, setup: StepSetup) -> torch.device:
    return torch.device(f"cuda:{rank}" if setup.device_kind == "cuda" else "cpu")


def _build(rank: int, setup: StepSetup, mode: str) -> tuple[torch.nn.Module, Any]:
    """The rank's quantized model for ``mode`` (under FSDP, other weights than rank 0's on
    the other ranks) and the backend's layer facet."""
    from ._workloads import quantized_model

    device = _device(rank, setup)
    facet = _backend(setup).layers()
    assert facet is not None, f"{setup.backend} offers no layer"
    seed = SEED if rank == 0 or mode != "fsdp" else OTHER_WEIGHTS_SEED
    with tempfile.TemporaryDirectory(dir=setup.folder) as scratch:
        caps = facet.capabilities(device)
        model = quantized_model(_Quiet(), facet, caps, setup.spec, "llama", setup.dtype, device, Path(scratch), seed)
    return model, facet


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP wraps one by one (accelerate's transformer-layer policy)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _adamw(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(parameters), lr=LR, eps=EPS, weight_decay=0.0)


def _wrapped(rank: int, mode: str, model: torch.nn.Module, device: torch.device):
    """``model`` under ``mode``'s wrapper, AdamW over its LoRA parameters as the wrapper
    leaves them, and how the wrapper runs a backward."""
    if mode == "fsdp-accelerate":
        return _accelerate_fsdp(rank, model)
    if mode == "ddp":
        wrapped: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if device.type == "cuda" else None
        )
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import fully_shard

        full = model.state_dict() if rank == 0 else {}
        for layer in decoder_layers(model):
            fully_shard(layer)
        wrapped = fully_shard(model)
        set_model_state_dict(
            wrapped, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        )
    return wrapped, _adamw(p for p in model.parameters() if p.requires_grad), torch.Tensor.backward


def _agree(ok: bool, device: torch.device) -> None:
    """Whether every rank wrapped its model; raises on the ranks that did when a peer did
    not. A rank that fails to load a broadcast state (HQQ under FSDP) would otherwise leave
    its peer waiting in the step's first collective, over NCCL until a timeout."""
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if ok and not int(flag.item()):
        raise RuntimeError("another rank failed to wrap its model (its traceback is in its part of this cell)")


def _accelerate_fsdp(rank: int, model: torch.nn.Module):
    """FSDP as accelerate sets it up for FSDP-QLoRA (the PEFT and bitsandbytes "fsdp_qlora"
    guides' accelerate config): ``FullyShardedDataParallelPlugin`` with FSDP2, the
    transformer-layer wrap policy and ``cpu_ram_efficient_loading``, the model and the
    optimizer through ``accelerator.prepare``, ``accelerator.backward``. No mixed precision
    policy (the step runs under the same autocast as the other modes, so one float64 shadow
    judges all three). Accelerate takes the process group this rank joined."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    # What ``accelerate launch`` hands each process (the group itself is already there).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        cpu_ram_efficient_loading=True,
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    if accelerator.distributed_type != DistributedType.FSDP:
        raise RuntimeError(f"accelerate runs this rank as {accelerator.distributed_type}, not FSDP")
    optimizer = _adamw(p for p in model.parameters() if p.requires_grad)
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    return wrapped, optimizer, accelerator.backward


def _step(rank: int, setup: StepSetup, mode: str, model: torch.nn.Module, facet: Any) -> dict[str, Any]:
    import peft

    from ._cases import reference_decode
    from ._workloads import LoraCalls, accumulated_lora_gradients, lora_targets, prompts

    device = _device(rank, setup)
    loaded = _model_hashes(model, facet)
    model = peft.prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    torch.manual_seed(401)  # the same adapters on every rank
    if facet.capabilities(device).peft:
        config = peft.LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=lora_targets(model, facet),
            lora_dropout=0.0,
            init_lora_weights=False,
        )
        model = peft.get_peft_model(model, config)
    else:
        model = with_lora(model, facet, device)
    model.train()
    try:
        wrapped, optimizer, backward = _wrapped(rank, mode, model, device)
    except Exception:
        _agree(False, device)
        raise
    _agree(True, device)
    inner = model  # the wrapper's module (FSDP shards it in place, accelerate's prepare too)
    adapters = {name: p for name, p in inner.named_parameters() if p.requires_grad}
    before = {name: _full(p.detach()).double().clone() for name, p in adapters.items()}
    ids, mask = prompts((8, 8), seed=409 + rank, device=device)
    autocast_dtype = setup.dtype if setup.dtype is not torch.float32 else None
    lora_calls = LoraCalls(inner, facet)
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = wrapped(input_ids=ids, attention_mask=mask, labels=ids).loss
    backward(loss)
    lora_calls.remove()
    gradients = {name: _full(p.grad).detach().cpu().clone() for name, p in adapters.items() if p.grad is not None}
    optimizer.step()
    updated = {name: _full(p.detach()).cpu().clone() for name, p in adapters.items()}
    if mode != "ddp":
        for module in inner.modules():  # every fully_shard group's full parameters, to read the layers' state
            if hasattr(module, "unshard") and hasattr(module, "reshard"):
                module.unshard()
    after = _model_hashes(inner, facet)
    shadows: dict[str, torch.Tensor] = {}
    for name, module in lora_calls.layers.items():
        base = module.get_base_layer()
        packed = facet.computing_state(base)
        a, b = (before[f"{name}.{what}.default.weight"] for what in ("lora_A", "lora_B"))
        grads = accumulated_lora_gradients(
            [(x.cpu(), dy.cpu(), autocast) for x, dy, autocast in lora_calls.calls[name]],
            packed,
            reference_decode(packed, torch.device("cpu")),
            a.cpu(),
            b.cpu(),
            ALPHA / RANK,
            facet.compute_dtype(base) or updated[f"{name}.lora_A.default.weight"].dtype,
            updated[f"{name}.lora_A.default.weight"].dtype,
        )
        for what in ("lora_A", "lora_B"):
            key = f"{name}.{what}.default.weight"
            shadows[key + ":exact"], shadows[key + ":bound"] = grads[what]
    return {
        "loaded": loaded,
        "after": after,
        "adapters": sorted(adapters),
        "before": {name: t.cpu() for name, t in before.items()},
        "gradients": gradients,
        "updated": updated,
        "shadows": shadows,
        "rows": int(ids.numel()),
        "pid": os.getpid(),
    }
