"""The checker catches each kind of mistake the upstream docs audit found, and names file:line.

Each test writes a page with one seeded mistake into a temporary docs directory and checks it with
the real CLI model; a clean page of the same shape must pass, so the checks do not just flag
everything. Run: pytest tests/docs/test_check_seeded.py
"""

from __future__ import annotations

import pytest

from miles.docs.check import Checker, normalize


def check(root, model, tmp_path, text: str, extra: dict[str, str] | None = None) -> list[str]:
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    for name, body in (extra or {}).items():
        (docs / name).write_text(body)
    page = docs / "page.md"
    page.write_text(text)
    checker = Checker(root, model, docs)
    checker.check_page(page)
    return [str(p) for p in checker.problems]


CLEAN = """# Page

Use `--rollout-batch-size` with `miles train --lr 1e-5`; `--update-weight-buffer-size` (default 536870912)
and `--prometheus-port` defaults to `9090`. See `miles/config/engine.py`, `miles.config.engine.option_specs`,
`PROMETHEUS_PORT`, `MILES_SCRIPT_MODEL_NAME`, variant `rocm700-mi35x`, and [below](#page).

```bash
miles train --rollout-batch-size 32 --dry-run
miles convert --from hf --to torch_dist --hf-checkpoint DIR --save OUT
```
"""


def test_a_clean_page_passes(root, model, tmp_path):
    assert check(root, model, tmp_path, CLEAN) == []
    table = "| flag | default |\n|---|---|\n| `--prometheus-port` | `9090` |\n| `--lr` | `1e-6` |\n"
    assert check(root, model, tmp_path, table) == []


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Run with `--rollout-batch-sise 8`.", "docs/page.md:1: --rollout-batch-sise is not an option of any miles command"),
        ("Run `miles convert --rollout-batch-size 8`.", "docs/page.md:1: --rollout-batch-size is not an option of miles convert"),
        ("It uses `--update-weight-buffer-size` (default 1 GB).", "docs/page.md:1: --update-weight-buffer-size: the page says the default is 1 GB, the code says 536870912"),
        ("Set `--prometheus-port` (default: 9091).", "docs/page.md:1: --prometheus-port: the page says the default is 9091, the code says 9090"),
        ("| flag | default |\n|---|---|\n| `--prometheus-port` | `9091` |\n", "docs/page.md:3: --prometheus-port: the table says the default is 9091, the code says 9090"),
        ("See `miles/ray/rollout.py`.", "docs/page.md:1: path miles/ray/rollout.py does not exist in the repository"),
        ("See `miles.utils.transformers_patch`.", "docs/page.md:1: miles.utils.transformers_patch: miles/utils/__init__.py defines no transformers_patch"),
        ("Call `miles.config.engine.no_such_function`.", "docs/page.md:1: miles.config.engine.no_such_function: miles/config/engine.py defines no no_such_function"),
        ("Build `rocm-mi300`.", "docs/page.md:1: docker variant rocm-mi300 does not exist"),
        ("Use `--advantage-estimator on_policy_distillation`.", "docs/page.md:1: --advantage-estimator on_policy_distillation: 'on_policy_distillation' is not a choice"),
        ("Set `MILES_HACK_TRAIN_TORCH_DETERMINISTIC=1`.", "docs/page.md:1: environment variable MILES_HACK_TRAIN_TORCH_DETERMINISTIC is not read by miles"),
        ("Set `MILES_SCRIPT_NUM_NODEZ`.", "docs/page.md:1: MILES_SCRIPT_NUM_NODEZ is not a recipe option variable"),
        ("[x](#no-such-heading)\n", "docs/page.md:1: link #no-such-heading: no heading or anchor #no-such-heading in page.md"),
        ("[x](other.md#gone)\n", "docs/page.md:1: link other.md#gone: no heading or anchor #gone in other.md"),
        ("[x](missing.md)\n", "docs/page.md:1: link missing.md: missing.md does not exist"),
        ("[x](../../README.md)\n", "docs/page.md:1: link ../../README.md"),
        ("```bash\nmiles train --no-such-flag 3\n```\n", "docs/page.md:2: `miles train --no-such-flag 3` does not parse: No such option: --no-such-flag"),
        ("```bash\nmiles docker-build --variant rocm-mi350 --image-tag dev\n```\n", "docs/page.md:2: `miles docker-build --variant rocm-mi350 --image-tag dev` does not parse: Invalid value for '--variant'"),
        ("```bash\nmiles train \\\n  --rollout-batch-size 1 --global-batch-size 64\n```\n", "docs/page.md:2: `miles train --rollout-batch-size 1 --global-batch-size 64` fails with --dry-run (exit 2): Error: --num-steps-per-rollout must be at least 1"),
        ("```bash\nmiles train --extra-args \"--lr x\"\n```\n", "docs/page.md:2: `miles train --extra-args --lr x` fails with --dry-run (exit 2): Error: --lr in --extra-args: 'x' is not a number"),
    ],
)
def test_each_seeded_mistake_is_caught_with_file_and_line(root, model, tmp_path, text, expected):
    problems = check(root, model, tmp_path, text, extra={"other.md": "# Other\n"})
    assert any(p.startswith(expected) for p in problems), problems
    assert len(problems) == 1, problems


def test_an_unemitted_metric_is_caught(root, model, tmp_path):
    checker = Checker(root, model, tmp_path)
    if checker.metrics is None:
        pytest.skip("miles/tracking/metric_names.py does not exist yet")
    known = checker.metrics[0][0]
    problems = check(root, model, tmp_path, f"Watch `{known}` and `rollout/mis_kl_made_up`.")
    assert problems == ["docs/page.md:1: metric rollout/mis_kl_made_up is not emitted by miles (not in miles/tracking/metric_names.py)"]


def test_lines_are_counted_past_code_blocks_and_a_flag_is_checked_for_its_command(root, model, tmp_path):
    text = "# T\n\n```bash\nmiles train --dry-run\n```\n\nThen `miles docker-build --sft-steps 3`.\n"
    assert check(root, model, tmp_path, text) == ["docs/page.md:7: --sft-steps is not an option of miles docker-build"]


def test_recipe_only_flags_are_real_for_the_run_commands(root, model, tmp_path):
    assert check(root, model, tmp_path, "Use `miles train --model-name qwen3-0.6b --task math`.") == []


def test_unchecked_region_skips_examples_but_not_links(root, model, tmp_path):
    text = "<!-- docs-check: off -->\n`rollout/made_up` `--nope` [x](#gone)\n<!-- docs-check: on -->\n"
    assert check(root, model, tmp_path, text) == ["docs/page.md:2: link #gone: no heading or anchor #gone in page.md"]


@pytest.mark.parametrize(
    "written, flag, value",
    [("512 MiB", "", 536870912.0), ("`true`", "", True), ("off", "", False), ("no-push", "--push", False),
     ("unset", "", None), ("1e-6", "", 1e-6), ("`miles`", "", "miles"), ("5 GiB", "", 5 * 2**30)],
)
def test_normalize_compares_values_as_written_in_prose(written, flag, value):
    assert normalize(written, flag) == value
