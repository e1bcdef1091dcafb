"""The one layer-hook helper (:mod:`worker.llm.hooks`) that the extractor's forward pass
and the inline guard's tap share."""

from __future__ import annotations

import pytest
import torch

from worker.llm.hooks import layer_hooks
from worker.llm.tiny import make_tiny_llm


def test_each_wanted_index_is_output_hidden_states_and_the_hooks_go_after() -> None:
    llm = make_tiny_llm()

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in llm.model.modules())

    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():  # transformers adds hooks of its own on the first call
        want = llm.model(ids, output_hidden_states=True).hidden_states
    before = hooks()
    got: dict[int, torch.Tensor] = {}
    top = llm.num_layers
    with torch.no_grad(), layer_hooks(llm, [top, 0, 2], got.__setitem__):
        assert hooks() == before + 3
        llm.model(ids)
    assert hooks() == before
    assert sorted(got) == [0, 2, top]
    for i in got:  # top: the model's last_hidden_state, after the final norm
        assert torch.allclose(got[i], want[i], atol=1e-6), i


def test_an_index_past_the_top_is_refused_and_nothing_stays_hooked() -> None:
    llm = make_tiny_llm()
    with pytest.raises(ValueError, match="not in"), layer_hooks(llm, [1, 99], lambda *_: None):
        pass
    assert not any(m._forward_hooks for m in llm.model.modules())
