"""The workloads' own checks, beside the oracle's: each must fail on the harness bug it is
there for (suites/_workloads.py)."""

from __future__ import annotations

import types

import pytest
import torch
from pytest_qconform.suites._workloads import check_cache_filled, float_model, prompts

from pytest_qconform.session.fixtures import Checker

transformers = pytest.importorskip("transformers")


def test_a_kv_cache_the_model_ignored_fails_the_workload():
    """A cache passed under a keyword the model does not take (here one no version takes,
    as ``past_key_values=`` will be once transformers removes it) is swallowed by the
    forward's ``**kwargs``: the call runs and returns finite logits, and the cache stays
    empty."""
    qcheck = Checker(types.SimpleNamespace(user_properties=[]))
    lm = float_model("llama", torch.float32, seed=0).eval()
    ids, _ = prompts((5, 5), seed=1, device=torch.device("cpu"))
    positions = torch.arange(ids.shape[1])
    used = transformers.StaticCache(config=lm.config, max_cache_len=8)
    ignored = transformers.StaticCache(config=lm.config, max_cache_len=8)
    with torch.no_grad():
        lm(input_ids=ids, past_key_values=used, cache_position=positions, use_cache=True)
        out = lm(input_ids=ids, kv_cache=ignored, cache_position=positions, use_cache=True)
    assert bool(torch.isfinite(out.logits).all())
    check_cache_filled(qcheck, used, ids.shape[1])
    with pytest.raises(AssertionError, match=r"KV cache the workload passed \(ignored: 0\): got 0, expected 5"):
        check_cache_filled(qcheck, ignored, ids.shape[1])


# -- the model-level check (suites/_replay.py): the whole model against a float64 replay --------


def _quantized_gpt2(dtype: torch.dtype):
    """GPT-2 (Conv1D layers, lm_head tied to the embedding) from its source checkpoint, every
    Conv1D replaced by the example backend's 4-bit layer, as ``quantized_model`` does for a
    backend without a transformers config; and the source, rebuilt from its seed."""
    from pytest_qconform.suites._workloads import SOURCE_SEED, _replace_linears
    from qconform_example_nf4.backend import TorchNF4Backend

    from pytest_qconform.backends.functional_layer import FunctionalLayers
    from pytest_qconform.backends.spec import QuantSpec

    facet = FunctionalLayers(TorchNF4Backend())

    def quantize(weight, bias, name):
        return facet.quantize(weight.cpu(), None if bias is None else bias.detach(), QuantSpec("nf4", 64), dtype, "cpu")

    lm = float_model("gpt2", dtype, SOURCE_SEED)
    _replace_linears(lm, quantize)
    return facet, lm.eval(), float_model("gpt2", dtype, SOURCE_SEED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_lm_head_left_at_its_initialization_fails_only_the_model_replay(dtype):
    """transformers#43429's class (Ministral-3: the tied-weights mapping left empty, so the
    checkpoint's missing ``lm_head.weight`` is initialized afresh instead of tied to the
    embedding): every 4-bit layer's call is right against its own bytes and the logits are
    finite, so the oracle and the workloads' other checks pass; the model replay, whose lm_head
    is the source's embedding, fails. The same model with its lm_head tied passes."""
    from pytest_qconform.suites._replay import MODEL_REPLAY_FACTOR, check_model_replay

    from pytest_qconform.watch import watch

    qcheck = Checker(types.SimpleNamespace(user_properties=[]))
    facet, lm, source = _quantized_gpt2(dtype)
    ids, mask = prompts((5, 2, 7), seed=307, device=torch.device("cpu"))
    assert check_model_replay(qcheck, facet, lm, source, ids, mask).ratio <= MODEL_REPLAY_FACTOR

    torch.manual_seed(0)
    lm.lm_head.weight = torch.nn.Parameter(torch.empty_like(lm.lm_head.weight).normal_(0.0, 0.02))  # untied, fresh
    with watch(lm, {"torch-nf4": facet}) as oracle, torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=mask).logits
    assert oracle.verdicts and not oracle.failures  # with the model check taken out: missed
    assert bool(torch.isfinite(logits).all())
    with pytest.raises(AssertionError, match=r"model replay: the quantized model's logits err \S+ x torch's dense"):
        check_model_replay(qcheck, facet, lm, source, ids, mask)
