"""megatron's layout checks (miles/config/megatron_checks.py): each bad layout is one UserError naming
its option, with the product that does not divide the workers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.config.megatron_checks import check_layout
from miles.errors import UserError


def cfg(**train):
    t = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
             expert_model_parallel_size=1, expert_tensor_parallel_size=1, sequence_parallel=False,
             recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    return SimpleNamespace(train=SimpleNamespace(**{**t, **train}), data=SimpleNamespace(global_batch_size=8))


@pytest.mark.parametrize("train, world, option, sentence", [
    ({"tensor_model_parallel_size": 3}, 4, "--tensor-model-parallel-size",
     "--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size = 3 does not divide the 4 training workers"),
    ({"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, 2, "--expert-model-parallel-size",
     "--expert-tensor-parallel-size x --expert-model-parallel-size x --pipeline-model-parallel-size = 4 does not divide the 2 training workers"),
    ({"expert_tensor_parallel_size": 0}, 2, "--expert-tensor-parallel-size", "--expert-tensor-parallel-size must be at least 1."),
])
def test_a_layout_that_cannot_be_laid_out_is_one_user_error(train, world, option, sentence):
    with pytest.raises(UserError) as e:
        check_layout(cfg(**train), world)
    assert sentence in str(e.value) and e.value.option == option


def test_a_layout_that_divides_the_workers_passes():
    check_layout(cfg(tensor_model_parallel_size=2, expert_model_parallel_size=2), 4)
