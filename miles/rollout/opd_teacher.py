"""On-policy distillation's engine teacher (`--use-opd --opd-type sglang`): the teacher's log-probs of
every sample's response tokens, from an engine serving the teacher at `--opd-teacher-urls`.

As upstream miles does it, each sample's whole token sequence (prompt + response) goes to the
teacher's `/generate` with `max_new_tokens` 0, `return_logprob` and `logprob_start_len` 0; the answer's
`meta_info.input_token_logprobs` holds one log-prob per token (the first, which nothing predicts, is
None); the last `response_length` entries are the teacher's log-probs of the response. Requests are
batched (`input_ids` as a list of lists). Unlike upstream (temperature 0, raw logits) the teacher
scores at `--rollout-temperature`, the temperature the trainer scores the student at, so the two
`--opd-type`s give the same numbers. Any SGLang server works, and so does miles' built-in engine
server (`python -m miles.rollout.engine.server --hf-checkpoint TEACHER --port 0`), on a CPU.

`TeacherScorer(url, student_dir=..., temperature=...)` checks at start that the engine answers and,
when its model directory is readable here (`/model_info`'s `model_path`), that its vocabulary size
is the student's; `scorer.score(tokens, response_lengths)` returns the per-sample lists that the
train data carries as `teacher_log_probs`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from miles.errors import UserError

BATCH = 64
"""Samples per /generate call."""
TIMEOUT_S = 600.0


def _vocab_size(hf_dir: Path) -> int | None:
    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return None if size is None else int(size)


class TeacherScorer:
    """Scores samples with the teacher engine at `url` (see the module docstring)."""

    def __init__(self, url: str, *, student_dir: str | None, temperature: float):
        self.url = url.rstrip("/")
        self.temperature = temperature
        info = self._call("/model_info", None, timeout_s=30.0)
        teacher_dir = Path(str(info.get("model_path", "")))
        teacher_vocab = _vocab_size(teacher_dir) if info.get("model_path") else None
        student_vocab = _vocab_size(Path(student_dir)) if student_dir else None
        if teacher_vocab is not None and student_vocab is not None and teacher_vocab != student_vocab:
            raise UserError(
                f"--opd-teacher-urls {url} serves {teacher_dir}, whose vocabulary has {teacher_vocab} tokens but the student "
                f"(--hf-checkpoint) has {student_vocab}; the teacher must score the student's token ids, so serve a teacher "
                "with the student's tokenizer.",
                option="--opd-teacher-urls",
            )

    def _call(self, path: str, body: dict[str, Any] | None, *, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as e:  # it answered, with an error: not a setup problem
            raise RuntimeError(f"the OPD teacher at {self.url} failed on {path}: HTTP {e.code} {e.read()[:500]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise UserError(
                f"--opd-teacher-urls {self.url} did not answer {path} ({e}); start the teacher's engine there "
                "(an SGLang server or `python -m miles.rollout.engine.server --hf-checkpoint TEACHER`).",
                option="--opd-teacher-urls",
            ) from None

    def score(self, tokens: list[list[int]], response_lengths: list[int]) -> list[list[float]]:
        """Per sample, the teacher's log-probs of its last `response_lengths[i]` tokens."""
        out: list[list[float]] = []
        for lo in range(0, len(tokens), BATCH):
            rows = tokens[lo : lo + BATCH]
            body = {
                "input_ids": [list(t) for t in rows],
                "sampling_params": {"max_new_tokens": 0, "temperature": self.temperature},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
            answers = self._call("/generate", body)
            answers = answers if isinstance(answers, list) else [answers]
            if len(answers) != len(rows):
                raise RuntimeError(f"the OPD teacher at {self.url} answered {len(answers)} of {len(rows)} prompts")
            for t, n, answer in zip(rows, response_lengths[lo : lo + BATCH], answers):
                entries = answer["meta_info"]["input_token_logprobs"]
                if len(entries) != len(t) or [int(e[1]) for e in entries[-n:] if n] != list(t[len(t) - n :]):
                    raise RuntimeError(
                        f"the OPD teacher at {self.url} scored {len(entries)} tokens of a {len(t)}-token sample, or other tokens"
                    )
                out.append([float(e[0]) for e in entries[len(t) - n :]] if n else [])
        return out
