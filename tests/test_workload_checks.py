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
