"""The generate seam through the real CLI: `--custom-generate-function-path` and `--rollout-function-path`.

One `miles full-train --mode debug_minimal` run with both options (fresh directories): the rollout
function draws the prompts and generates every sample through the run's generate function, which
cuts each response to its first token and records it. The run's rollout dumps
(`--save-debug-rollout-data`, the samples that became train data) must be exactly those samples; the
rollout function's metric must be in metrics.jsonl; eval samples come from the generate function too.
With either option ignored, the records or the metric are missing and the test fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MILES = [sys.executable, "-m", "miles_cli.main"]

HOOKS = '''
"""Hooks of tests/e2e/test_generate_seam.py: they run in the rollout manager's process and write down what they did."""
import dataclasses
import json
from pathlib import Path

from miles.rollout.generate_hub import GenerateOutput, RolloutFnOutput
from miles.rollout.generate_hub.single_turn import generate as single_turn

LOG = Path(__file__).with_name("calls.jsonl")


def _log(**row):
    with LOG.open("a") as f:
        f.write(json.dumps(row) + "\\n")


async def first_token(input):
    s = await single_turn(input)
    out = dataclasses.replace(s, tokens=s.tokens[: s.prompt_length + 1], response_length=1,
                              rollout_log_probs=s.rollout_log_probs[:1], metadata={**s.metadata, "made_by": "first_token"})
    _log(kind="generate", rollout_id=input.rollout_id, evaluation=input.evaluation, index=s.index, tokens=out.tokens)
    return GenerateOutput(out)


async def rollout(input):
    d = input.cfg.data
    groups = input.data_source.get_samples(d.rollout_batch_size, d.n_samples_per_prompt)
    out = []
    for g in groups:
        made = []
        for s in g:
            for m in await input.generate(s):
                m.metadata = {**m.metadata, "rollout_fn": input.rollout_id}
                made.append(m)
        out.append(made)
    _log(kind="rollout", rollout_id=input.rollout_id, samples=sum(map(len, out)))
    return RolloutFnOutput(out, metrics={"rollout/seam_samples": float(sum(map(len, out)))})
'''


def test_custom_generate_and_rollout_functions_make_the_samples_a_real_run_trains_on(tmp_path: Path):
    hooks = tmp_path / "seam_hooks.py"
    hooks.write_text(HOOKS)
    dumps = tmp_path / "dumps"
    extra = (f"--custom-generate-function-path {hooks}:first_token --rollout-function-path {hooks}:rollout "
             f"--save-debug-rollout-data {dumps}/rollout_{{rollout_id}}.jsonl")
    argv = ["full-train", "--mode", "debug_minimal", "--model-dir", str(tmp_path / "models"), "--data-dir", str(tmp_path / "data"),
            "--output-dir", str(tmp_path / "runs"), "--run-id", "seam", "--extra-args", extra]
    r = subprocess.run(MILES + argv, cwd=tmp_path, capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"

    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    rollouts = [c for c in calls if c["kind"] == "rollout"]
    made = {(c["rollout_id"], c["index"]): c["tokens"] for c in calls if c["kind"] == "generate" and not c["evaluation"]}
    assert [c["rollout_id"] for c in rollouts] == [0, 1, 2]  # debug_minimal: 3 rollouts
    per_rollout = rollouts[0]["samples"]
    assert per_rollout == 32 * 8 and len(made) == 3 * per_rollout  # every sample of every rollout, once each

    for rollout_id in range(3):
        trained = [json.loads(line) for line in (dumps / f"rollout_{rollout_id}.jsonl").read_text().splitlines()]
        assert len(trained) == per_rollout
        for s in trained:
            assert s["metadata"]["made_by"] == "first_token" and s["metadata"]["rollout_fn"] == rollout_id
            assert s["response_length"] == 1 and s["tokens"] == made[(rollout_id, s["index"])]

    rows = [json.loads(line) for line in (tmp_path / "runs" / "seam" / "metrics.jsonl").read_text().splitlines()]
    assert [row["rollout/seam_samples"] for row in rows if "rollout/seam_samples" in row] == [float(per_rollout)] * 3
    assert [row["rollout/response_len_mean"] for row in rows if "rollout/response_len_mean" in row] == [1.0] * 3
    evals = [row["eval/arith/response_len_mean"] for row in rows if "eval/arith/response_len_mean" in row]
    assert evals and all(v == 1.0 for v in evals)  # eval samples are the generate function's too
    assert any(c["kind"] == "generate" and c["evaluation"] for c in calls)
