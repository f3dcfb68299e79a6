"""Every reward type of the hub against verdicts and numbers worked out by hand.

Run: pytest tests/rollout/test_rm_types.py
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from miles.config.reward import KNOWN_RM_TYPES, RewardConfig
from miles.errors import UserError
from miles.rollout.rm_hub import SCORERS, compute_group_rewards, compute_reward
from miles.rollout.rm_hub.boxed import last_boxed_content
from miles.rollout.rm_hub.dapo import normalize_answer
from miles.rollout.rm_hub.f1 import f1_precision_recall
from miles.rollout.rm_hub.gpqa import chosen_letter
from miles.sample import Sample


def reward(rm_type: str, response: str, label=None, **sample_fields):
    cfg = RewardConfig(rm_type=rm_type, reward_key="score" if "dapo" in rm_type else None)
    return asyncio.run(compute_reward(cfg, Sample(response=response, label=label, **sample_fields)))


def test_hub_table_matches_the_declared_types():
    assert set(SCORERS) | {"remote_rm"} == set(KNOWN_RM_TYPES)


# --- boxed extraction -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("x \\boxed{2} y \\boxed{3}", "3"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{{a}{b}} tail", "{a}{b}"),
        ("no box here", None),
        ("\\boxed{2} then truncated \\boxed{3", None),
        ("", None),
        ("\\fbox{7}", "7"),
    ],
)
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


# --- math ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("So the result is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
        ("\\boxed{2}", "3", 0.0),
        ("The answer is \\boxed{2,3}", "\\{2,3\\}", 1.0),
        ("We expand: \\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt2}{2}", 1.0),
        ("first \\boxed{2}, corrected: \\boxed{3}", "3", 1.0),  # the last box is the answer
        ("first \\boxed{3}, corrected: \\boxed{2}", "3", 0.0),
        ("", "1", 0.0),
        ("\\boxed{7}", "\\boxed{7}", 1.0),  # a boxed label is unboxed too
        ("\\boxed{7}", 7, 1.0),  # integer labels (parquet) work
    ],
)
def test_math(response, label, expected):
    assert reward("math", response, label) == expected


@pytest.mark.parametrize(
    "response, label",
    [
        ("so x = 12. Then we check whether 12 satisfies", "12"),  # truncated before it committed
        ("<think>x is 12</think>", "12"),  # the answer only in the reasoning, never boxed
        ("So the result is $0.5$.", "\\frac{1}{2}"),
    ],
)
def test_math_without_a_closed_box_scores_zero_unless_the_fallback_is_asked_for(response, label):
    # Upstream's grader: no committed (boxed) answer, no reward. --math-free-text-fallback grades the
    # free text instead, so each of these (a correct number somewhere in the text) then earns 1.
    assert reward("math", response, label) == 0.0
    cfg = RewardConfig(rm_type="math", math_free_text_fallback=True)
    assert asyncio.run(compute_reward(cfg, Sample(response=response, label=label))) == 1.0


def test_math_a_box_left_open_by_truncation_is_no_box():
    assert reward("math", "the answer is \\boxed{12", "12") == 0.0


def test_math_free_text_fallback_is_rejected_where_it_would_do_nothing():
    RewardConfig(rm_type="math", math_free_text_fallback=True).check()
    for kwargs in ({"rm_type": "boxed_math"}, {"rm_type": "f1"}, {"rm_type": "math", "custom_rm_path": "m.fn"}):
        with pytest.raises(UserError, match="--math-free-text-fallback") as e:
            RewardConfig(math_free_text_fallback=True, **kwargs).check()
        assert e.value.option == "--math-free-text-fallback"


def test_math_works_off_the_main_thread():
    # math-verify's timeouts use SIGALRM, which raises ValueError outside the main thread (Ray actors
    # score rewards in worker threads); the grader must then run without them instead of failing.
    results = []
    thread = threading.Thread(target=lambda: results.append(reward("math", "\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(timeout=60)
    assert results == [1.0]


def test_math_without_label_is_a_data_error_naming_the_flag():
    with pytest.raises(UserError, match="--label-key"):
        reward("math", "\\boxed{1}", None)


def test_boxed_prefix_scores_only_the_last_box():
    # With a box, both take the last one; without a box, both score 0.
    assert reward("boxed_math", "I guess 2... \\boxed{3}", "3") == 1.0
    assert reward("boxed_math", "\\boxed{3} no wait \\boxed{2}", "3") == 0.0
    assert reward("math", "the answer is 3", "3") == 0.0
    assert reward("boxed_math", "the answer is 3", "3") == 0.0
    assert reward("boxed_exact_match", "work... \\boxed{ 12 }", "12") == 1.0


# --- deepscaler ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("<think>maybe \\boxed{4}</think> so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("<think>\\boxed{0.5}</think> final answer 0.5", "0.5", 0.0),  # no box after </think>
        ("\\boxed{0.5}", "0.5", 0.0),  # no </think> and no ###Response: 0
        ("###Response the answer \\boxed{12}", "12", 1.0),
        ("<think></think>\\boxed{12}", "", 0.0),
    ],
)
def test_deepscaler(response, label, expected):
    assert reward("deepscaler", response, label) == expected


# --- dapo ---------------------------------------------------------------------------------------


def test_dapo_scores_plus_minus_one_on_the_last_answer_line():
    assert reward("dapo", "reasoning...\nAnswer: 34", "34") == {"score": 1.0, "acc": True, "pred": "34"}
    assert reward("dapo", "Answer: 12\nwait, no.\nAnswer: 34", "34")["score"] == 1.0
    assert reward("dapo", "Answer: 34\nActually Answer: 35", "34") == {"score": -1.0, "acc": False, "pred": "35"}
    # No answer line at all: -1 and the placeholder prediction.
    assert reward("dapo", "the result is 34", "34") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert reward("dapo", "", "34")["score"] == -1.0


def test_dapo_label_is_read_as_an_integer_and_only_the_tail_counts():
    assert reward("dapo", "Answer: $\\boxed{1,000}$.", "1000.0")["score"] == 1.0
    assert reward("dapo", "answer : x = 7", "7")["score"] == 1.0
    # An answer line further than 300 characters from the end is not seen.
    assert reward("dapo", "Answer: 34\n" + "." * 300, "34")["score"] == -1.0


@pytest.mark.parametrize(
    "raw, normalized",
    [
        ("$5$", "5"), ("\\text{5}.", "5"), ("x=\\boxed{12}", "12"), ("90^\\circ", "90"), ("1,234,567", "1234567"),
        ("1,2", "1,2"),  # a pair, not a thousands separator
        # units and counted words, as whole words (the DAPO grader's normalisation)
        ("42 degrees", "42"), ("12 cm", "12"), ("5 dollars", "5"), ("12 \\text{cm}", "12"), ("8 \\text{ cm}^2", "8"),
        ("\\$5", "5"), ("10\\%", "10"), ("an 8", "8"),
        # the first $...$ span of a sentence, and Minerva's wrapper sentence
        ("The final answer is $42$. I hope it is correct.", "42"),
        ("The final answer is 42. I hope it is correct.", "42"),
        ("it is $x = 7$ since $y$", "7"),
        # TeX shorthand
        ("\\frac12", "\\frac{1}{2}"), ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("\\sqrt2", "\\sqrt{2}"),
    ],
)
def test_dapo_normalization(raw, normalized):
    assert normalize_answer(raw) == normalized


@pytest.mark.parametrize(
    "response, label",
    [
        ("so the angle is\nAnswer: 42 degrees", "42"),
        ("Answer: 12 cm", "12"),
        ("Answer: 5 dollars", "5"),
        ("Final Answer: The final answer is $42$. I hope it is correct.", "42"),
        ("... The final answer is $42$. I hope it is correct.", "42"),  # Minerva's sentence without "Answer:"
        ("Answer: 0.5", "0.5"),  # non-integer labels stay as they are (not int("0.5") -> 0)
        ("Answer: \\frac12", "\\frac{1}{2}"),
        ("Answer: 34.0", "34"),
    ],
)
def test_dapo_accepts_what_the_dapo_grader_accepts(response, label):
    assert reward("dapo", response, label)["score"] == 1.0


def test_dapo_rejects_near_misses():
    assert reward("dapo", "Answer: 0", "0.5")["score"] == -1.0  # 0.5 is not truncated to 0
    assert reward("dapo", "Answer: 43 degrees", "42")["score"] == -1.0
    assert reward("dapo", "Answer: $$", "")["score"] == -1.0  # nothing never matches nothing


# --- f1 -----------------------------------------------------------------------------------------


def test_f1_by_hand():
    # pred "the cat sat on the mat" -> [cat, sat, on, mat]; label "a cat on a hat" -> [cat, on, hat].
    # common = {cat, on} = 2; P = 2/4, R = 2/3; F1 = 2PR/(P+R) = (2/3)/(7/6) = 4/7.
    f1, p, r = f1_precision_recall("The cat sat on the mat.", "a cat on a hat")
    assert (p, r) == (0.5, 2 / 3)
    assert f1 == pytest.approx(4 / 7, abs=1e-12)
    assert reward("f1", "The cat sat on the mat.", "a cat on a hat") == pytest.approx(4 / 7, abs=1e-12)


def test_f1_edge_cases():
    assert reward("f1", "", "paris") == 0.0
    assert reward("f1", "Paris!", "paris") == 1.0
    # Tokens are a multiset: "paris paris" vs "paris" has 1 common token, P = 1/2, R = 1, F1 = 2/3.
    assert reward("f1", "paris paris", "paris") == pytest.approx(2 / 3)
    assert reward("f1", "yes it is", "yes") == 0.0  # closed answers must match exactly
    assert reward("f1", "Yes.", "yes") == 1.0


# --- gpqa ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, label, metadata, expected",
    [
        ("Reasoning... The answer is (B).", "B", {}, 1.0),
        ("Reasoning... The answer is (B).", "C", {}, 0.0),
        ("A long derivation.\nFinal: \\boxed{C}", 2, {}, 1.0),  # label as 0-based index
        ("<think>the answer is A</think>\nAnswer: D", "D", {}, 1.0),  # thinking is ignored
        ("A cat would say the answer is a prime.", "A", {}, 0.0),  # article 'A' / word 'a' are no choice
        ("\\boxed{E}", "E", {"choices": ["1", "2", "3", "4", "5"]}, 1.0),
        ("\\boxed{E}", "A", {}, 0.0),  # E is not among the default A-D: no choice made
        ("The answer is B", "Paris", {"choices": ["Lyon", "Paris", "Nice"]}, 1.0),
        ("The answer is B", None, {"correct_letter": "b"}, 1.0),
        ("", "A", {}, 0.0),
    ],
)
def test_gpqa(response, label, metadata, expected):
    assert reward("gpqa", response, label, metadata=metadata) == expected


def test_gpqa_unknown_correct_option_is_a_data_error():
    with pytest.raises(UserError, match="correct option"):
        reward("gpqa", "The answer is B", "Paris")


def test_gpqa_last_line_letter():
    assert chosen_letter("lots of text\n(C)", "ABCD") == "C"
    assert chosen_letter("lots of text\nC.", "ABCD") == "C"
    assert chosen_letter("no choice made", "ABCD") is None


# --- exact_match, deterministic_random, random --------------------------------------------------


@pytest.mark.parametrize(
    "response, label, expected",
    [("12", "12", 1.0), (" 12\n", "12", 1.0), ("012", "12", 0.0), ("12", 12, 1.0), ("", "", 1.0), ("", "1", 0.0)],
)
def test_exact_match(response, label, expected):
    assert reward("exact_match", response, label) == expected


def test_deterministic_random_is_the_first_sha256_byte_mod_2():
    # sha256(b"1,2,3|abc")[0] = 20 -> 0; sha256(b"1,2,3|abd")[0] = 175 -> 1; sha256(b"|")[0] = 203 -> 1
    assert reward("deterministic_random", "abc", tokens=[1, 2, 3]) == 0.0
    assert reward("deterministic_random", "abd", tokens=[1, 2, 3]) == 1.0
    assert reward("deterministic_random", "", tokens=[]) == 1.0
    # sha256(b"5|x")[0] = 188 -> 0, and it does not depend on the label.
    assert reward("deterministic_random", "x", "anything", tokens=[5]) == 0.0


def test_random_gives_zero_or_one():
    assert {reward("random", "x") for _ in range(40)} == {0.0, 1.0}


# --- dispatch -----------------------------------------------------------------------------------


def test_metadata_rm_type_overrides_the_flag():
    cfg = RewardConfig(rm_type="exact_match")
    sample = Sample(response="\\boxed{0.5}", label="\\frac12", metadata={"rm_type": "math"})
    assert asyncio.run(compute_reward(cfg, sample)) == 1.0
    assert asyncio.run(compute_reward(cfg, Sample(response="\\boxed{0.5}", label="\\frac12"))) == 0.0


def test_unknown_type_lists_the_known_ones():
    with pytest.raises(UserError) as e:
        reward("maths", "1", "1")
    for name in KNOWN_RM_TYPES:
        assert name in str(e.value)
    with pytest.raises(UserError, match="metadata"):
        asyncio.run(compute_reward(RewardConfig(rm_type="math"), Sample(response="1", label="1", metadata={"rm_type": "nope"})))


def test_no_type_at_all_says_what_to_set():
    with pytest.raises(UserError, match="--rm-type"):
        asyncio.run(compute_reward(RewardConfig(), Sample(response="1", label="1")))


def test_group_without_group_rm_scores_each_sample_in_order():
    group = [Sample(response=r, label="4") for r in ("4", "5", " 4 ")]
    assert asyncio.run(compute_group_rewards(RewardConfig(rm_type="exact_match"), group)) == [1.0, 0.0, 1.0]
