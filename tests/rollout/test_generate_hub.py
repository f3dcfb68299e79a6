"""The generate seam's parts: the engine client, single-turn, loading by path, output checks."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future

import pytest

from miles.errors import UserError
from miles.rollout.engine.base import GenerateRequest, GenerateResponse, RolloutEngine, SamplingParams
from miles.rollout.generate_hub import EngineClient, GenerateInput, GenerateOutput, load_generate_function, load_rollout_function
from miles.rollout.generate_hub.single_turn import fill_from_response, request_for
from miles.rollout.generate_hub.types import RolloutFnOutput, as_groups, as_samples
from miles.sample import Sample, SampleStatus


class FakeEngine(RolloutEngine):
    """Futures the test finishes by hand; records what was submitted and whether inside `submitting_together`."""

    def __init__(self):
        self.futures: list[Future] = []
        self.requests: list[GenerateRequest] = []
        self.batches: list[list[str | None]] = []
        self.aborts: list[str] = []
        self._inside = False

    def submitting_together(self):
        engine = self

        class Together:
            def __enter__(self):
                engine._inside = True
                engine.batches.append([])

            def __exit__(self, *exc):
                engine._inside = False

        return Together()

    def submit(self, request):
        assert self._inside, "a request reached the engine outside submitting_together()"
        if request.sampling_params.max_new_tokens < 0:
            raise ValueError("rejected")
        self.batches[-1].append(request.rid)
        self.requests.append(request)
        f: Future = Future()
        self.futures.append(f)
        return f

    def abort_request(self, rid="", abort_all=False):
        self.aborts.append(rid)

    begin_weight_update = update_weights_from_tensors = end_weight_update = pause_generation = None  # type: ignore[assignment]
    continue_generation = flush_cache = release_memory_occupation = resume_memory_occupation = health = None  # type: ignore[assignment]
    get_weights_checksum = None  # type: ignore[assignment]


FakeEngine.__abstractmethods__ = frozenset()


def response(ids, finish="stop", rid=None):
    return GenerateResponse(output_ids=list(ids), text="".join(map(str, ids)), finish_type=finish, prompt_tokens=1,
                            weight_version=3, output_token_logprobs=[-0.5] * len(ids), rid=rid)


def req(rid):
    return GenerateRequest(input_ids=[1], rid=rid)


def test_one_turn_of_requests_goes_out_together_and_answers_keep_their_order():
    engine = FakeEngine()
    client = EngineClient(engine)

    async def main():
        tasks = [asyncio.ensure_future(client.generate(req(f"r{i}"))) for i in range(3)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert engine.batches == [["r0", "r1", "r2"]]  # one batch, in the order asked
        later = asyncio.ensure_future(client.generate(req("r3")))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert engine.batches == [["r0", "r1", "r2"], ["r3"]]
        for i in (2, 0, 3, 1):  # finished out of order, from another thread
            t = threading.Thread(target=engine.futures[i].set_result, args=(response([i], rid=f"r{i}"),))
            t.start()
            t.join()
        return [r.output_ids for r in await asyncio.gather(*tasks, later)]

    assert asyncio.run(main()) == [[0], [1], [2], [3]]


def test_errors_and_cancellations_reach_only_their_own_waiter():
    engine = FakeEngine()
    client = EngineClient(engine)

    async def main():
        ok, bad, gone = (asyncio.ensure_future(client.generate(req(r))) for r in ("ok", "bad", "gone"))
        rejected = asyncio.ensure_future(client.generate(GenerateRequest([1], SamplingParams(max_new_tokens=0), rid="x")))
        rejected_at_submit = GenerateRequest([1], rid="y")
        rejected_at_submit.sampling_params.max_new_tokens = -1  # the fake engine refuses it at submit
        refused = asyncio.ensure_future(client.generate(rejected_at_submit))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        engine.futures[1].set_exception(RuntimeError("engine died"))
        engine.futures[2].cancel()
        with pytest.raises(RuntimeError, match="engine died"):
            await asyncio.wait_for(bad, 5)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(gone, 5)
        with pytest.raises(ValueError, match="rejected"):
            await asyncio.wait_for(refused, 5)
        assert not ok.done()  # the others are not failed with them
        engine.futures[0].set_result(response([7]))
        engine.futures[3].set_result(response([]))
        return (await asyncio.wait_for(ok, 5)).output_ids, (await rejected).output_ids

    assert asyncio.run(main()) == ([7], [])


def test_answers_that_arrive_together_wake_the_loop_once():
    engine = FakeEngine()
    client = EngineClient(engine)
    delivered: list[int] = []
    deliver = EngineClient._deliver

    def counting(side):
        delivered.append(len(side.inbox))
        deliver(side)

    client._deliver = counting  # type: ignore[method-assign]

    async def main():
        tasks = [asyncio.ensure_future(client.generate(req(f"r{i}"))) for i in range(8)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)

        def finish_all():  # an engine step finishing 8 rows at once
            for i, f in enumerate(engine.futures):
                f.set_result(response([i]))

        t = threading.Thread(target=finish_all)
        t.start()
        t.join()
        return await asyncio.gather(*tasks)

    assert len(asyncio.run(main())) == 8
    assert delivered == [8]


def test_abort_ends_requests_in_flight_unsent_and_later_under_the_prefix():
    engine = FakeEngine()
    client = EngineClient(engine)

    async def main():
        sent = asyncio.ensure_future(client.generate(req("train-000001-000001-0000")))
        other = asyncio.ensure_future(client.generate(req("train-000002-000001-0000")))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        unsent = asyncio.ensure_future(client.generate(req("train-000001-000002-0000")))
        await asyncio.sleep(0)  # asked for, not yet sent
        await client.abort("train-000001-")
        later = await client.generate(req("train-000001-000003-0000t2"))  # e.g. a next turn
        engine.futures[0].set_result(response([1], finish="abort"))
        engine.futures[1].set_result(response([2]))
        return (await sent).finish_type, (await unsent).finish_type, later.finish_type, (await other).finish_type

    assert asyncio.run(main()) == ("abort", "abort", "abort", "stop")
    assert engine.aborts == ["train-000001-"]
    assert [r.rid for r in engine.requests] == ["train-000001-000001-0000", "train-000002-000001-0000"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from miles.prepare.tiny_model import create_tiny_qwen3

    return str(create_tiny_qwen3(tmp_path_factory.mktemp("gh") / "hf", seed=0))


def test_the_in_process_engine_and_its_server_by_url_answer_the_same(tiny_model):
    """`EngineClient(engine)` and `EngineClient.from_url(server)` are one API with one answer."""
    from miles.rollout.engine.builtin import BuiltinEngine
    from miles.rollout.engine.server import EngineServer

    request = GenerateRequest(input_ids=[3, 4, 5], sampling_params=SamplingParams(max_new_tokens=5, seed=11), return_logprob=True)
    engine = BuiltinEngine(tiny_model)
    local = asyncio.run(EngineClient(engine).generate(request))
    server = EngineServer(BuiltinEngine(tiny_model))
    server.start()
    try:
        remote = asyncio.run(EngineClient.from_url(server.url).generate(request))
    finally:
        server.stop()
    assert remote.output_ids == local.output_ids and len(local.output_ids) > 0
    assert remote.output_token_logprobs == pytest.approx(local.output_token_logprobs, abs=1e-6)


# ---------------------------------------------------------------------------------------------- single turn


def make_input(sample, *, context=None, max_new=8, tokenizer=None):
    from types import SimpleNamespace

    cfg = SimpleNamespace(rollout=SimpleNamespace(rollout_max_context_len=context))
    return GenerateInput(sample=sample, sampling_params=SamplingParams(max_new_tokens=max_new, seed=5), engine=None,  # type: ignore[arg-type]
                         cfg=cfg, tokenizer=tokenizer, rollout_id=0, rid="r-")  # type: ignore[arg-type]


def test_single_turn_request_uses_the_prompt_ids_caps_to_the_context_and_keeps_seed_and_rid():
    s = Sample(prompt="1+1=", tokens=[1, 2, 3, 4])
    q = request_for(make_input(s, context=6, max_new=8))
    assert q.input_ids == [1, 2, 3, 4] and q.sampling_params.max_new_tokens == 2 and q.sampling_params.seed == 5
    assert q.rid == "r-" and q.return_logprob
    assert request_for(make_input(s, context=3)).sampling_params.max_new_tokens == 0
    assert request_for(make_input(s)).sampling_params.max_new_tokens == 8  # no context limit

    class Tok:
        def encode(self, text, add_special_tokens):
            assert add_special_tokens is False
            return [ord(c) for c in text]

    bare = Sample(prompt="ab")
    assert request_for(make_input(bare, tokenizer=Tok())).input_ids == [97, 98] and bare.tokens == [97, 98]


@pytest.mark.parametrize("finish,status", [("stop", SampleStatus.COMPLETED), ("length", SampleStatus.TRUNCATED), ("abort", SampleStatus.ABORTED)])
def test_single_turn_fill_appends_the_engines_tokens(finish, status):
    s = Sample(tokens=[1, 2])
    fill_from_response(s, response([7, 8], finish=finish))
    assert (s.tokens, s.response_length, s.response, s.rollout_log_probs, s.status, s.weight_version) == (
        [1, 2, 7, 8], 2, "78", [-0.5, -0.5], status, 3)


# ---------------------------------------------------------------------------------------------- loading

HOOKS = '''
async def gen(input):
    return input.sample

def sync_gen(input):
    return input.sample

class Gen:
    async def __call__(self, input):
        return input.sample

async_object = Gen()
not_callable = 3
'''


@pytest.fixture()
def hooks(tmp_path):
    path = tmp_path / "hooks.py"
    path.write_text(HOOKS)
    return path


def test_generate_and_rollout_functions_load_by_file_and_module_path(hooks):
    assert load_generate_function(None).__module__ == "miles.rollout.generate_hub.single_turn"
    assert load_generate_function(f"{hooks}:gen").__name__ == "gen"
    assert load_generate_function(f"{hooks}:async_object") is not None
    assert load_generate_function("miles.rollout.generate_hub.single_turn.generate").__name__ == "generate"
    assert load_rollout_function(None) is None
    assert load_rollout_function(f"{hooks}:gen").__name__ == "gen"


@pytest.mark.parametrize(
    "attr,fragment",
    [("sync_gen", "is not an async function"), ("Gen", "is a class"), ("not_callable", "is not callable"), ("nope", "has no attribute 'nope'")],
)
def test_a_path_that_is_not_an_async_function_is_a_user_error_naming_the_option(hooks, attr, fragment):
    for load, flag in ((load_generate_function, "--custom-generate-function-path"), (load_rollout_function, "--rollout-function-path")):
        with pytest.raises(UserError, match=fragment) as e:
            load(f"{hooks}:{attr}")
        assert e.value.option == flag and str(e.value).startswith(flag)
    with pytest.raises(UserError, match="cannot be imported"):
        load_generate_function("no_such_module.generate")


# ---------------------------------------------------------------------------------------------- outputs


def test_outputs_are_one_sample_a_list_or_generate_output_numbered_like_their_input():
    src = Sample(index=5, group_index=2)
    assert as_samples(src, src, flag="--x") == [src]
    assert as_samples(GenerateOutput(src), src, flag="--x") == [src]
    new = [Sample(), Sample(index=9, group_index=2)]
    out = as_samples(GenerateOutput(new), src, flag="--x")
    assert [(s.index, s.group_index) for s in out] == [(5, 2), (9, 2)]
    for bad, fragment in (([], "no samples"), ("text", "returned str"), ([src, 1], "returned list"), (None, "returned NoneType")):
        with pytest.raises(UserError, match=fragment):
            as_samples(bad, src, flag="--custom-generate-function-path")


def test_rollout_outputs_are_groups_with_metrics():
    g = [[Sample()], [Sample(), Sample()]]
    assert as_groups(g, flag="--x") == (g, {})
    assert as_groups(RolloutFnOutput(g, metrics={"rollout/mine": 1.0}), flag="--x") == (g, {"rollout/mine": 1.0})
    for bad in ([], [[]], [Sample()], None, [[Sample(), "x"]]):
        with pytest.raises(UserError, match="--rollout-function-path returned"):
            as_groups(bad, flag="--rollout-function-path")


def test_the_contract_types_are_importable_without_torch():
    import subprocess
    import sys

    code = "import sys, miles.rollout.generate_hub; print(json.dumps(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
