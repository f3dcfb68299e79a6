"""The generate hub: how a rollout turns prompts into samples, as functions a user can replace.

Two seams, from small to large:

- **A generate function** makes the samples of one prompt sample:
  `async def generate(input: GenerateInput) -> GenerateOutput` (a bare `Sample` or list of them is
  accepted too). `--custom-generate-function-path module.fn` (or `path/to/file.py:fn`) selects it; the
  default is `single_turn.generate`, one engine request per sample. It runs for every sample of
  training rollouts and of eval, each in its own task: the rollout draws prompt groups, generates
  every sample, scores each group (samples that already carry a `reward` keep it), applies the dynamic
  sampling filter and aborts what is still in flight once --rollout-batch-size groups are kept.
- **A rollout function** replaces all of that for training rollouts:
  `async def rollout(input: RolloutFnInput) -> RolloutFnOutput` (or the bare list of groups), selected
  by `--rollout-function-path`. It is given the rollout id, the prompt data source, the engine client,
  the configuration and `input.generate` (the run's generate function with the built-in rollout's
  per-sample seeds) and returns --rollout-batch-size x --n-samples-per-prompt samples as prompt
  groups. The rollout manager scores the ones without a reward, turns them into train data and logs
  the rollout metrics plus the function's own. Eval still runs the generate function per sample.

Both reach the engines through `EngineClient` (`await engine.generate(GenerateRequest)`), the same for
the in-process engine and for engine servers behind the router. Contracts: `types.py`; loading and its
checks: `loading.py`. Imports neither torch nor Ray.
"""

from miles.rollout.generate_hub.engine_client import EngineClient
from miles.rollout.generate_hub.loading import load_generate_function, load_rollout_function
from miles.rollout.generate_hub.seeding import request_seed
from miles.rollout.generate_hub.types import GenerateInput, GenerateOutput, RolloutFnInput, RolloutFnOutput

__all__ = [
    "EngineClient",
    "GenerateInput",
    "GenerateOutput",
    "RolloutFnInput",
    "RolloutFnOutput",
    "load_generate_function",
    "load_rollout_function",
    "request_seed",
]
