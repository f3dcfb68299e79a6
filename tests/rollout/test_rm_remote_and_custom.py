"""remote_rm against a real HTTP server in a thread, and --custom-rm-path hooks (single and --group-rm).

Run: pytest tests/rollout/test_rm_remote_and_custom.py
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from pathlib import Path

import pytest

from miles.config.reward import RewardConfig
from miles.errors import UserError
from miles.rollout.rm_hub import RemoteRewardError, _custom_rm, compute_group_rewards, compute_reward
from miles.rollout.rm_hub.remote import post_reward
from miles.sample import Sample


class RewardServer:
    """A local reward server whose next answers are scripted: a list of (status, body, delay_s)."""

    def __init__(self, script: list[tuple[int, object, float]]):
        self.script = list(script)
        self.requests: list[dict] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                status, answer, delay = server.script.pop(0) if len(server.script) > 1 else server.script[0]
                time.sleep(delay)
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting, as the timeout test wants

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def remote_cfg(url: str, **kw) -> RewardConfig:
    return RewardConfig(rm_type="remote_rm", rm_url=url, **kw)


def test_remote_posts_prompt_response_label_and_returns_the_number():
    with RewardServer([(200, 0.75, 0.0)]) as server:
        sample = Sample(prompt=[{"role": "user", "content": "1+1?"}], response="2", label="2")
        assert asyncio.run(compute_reward(remote_cfg(server.url), sample)) == 0.75
    assert server.requests == [{"prompt": [{"role": "user", "content": "1+1?"}], "response": "2", "label": "2"}]


def test_remote_dict_answer_is_kept_whole_for_reward_key():
    with RewardServer([(200, {"score": 1, "acc": True}, 0.0)]) as server:
        assert asyncio.run(compute_reward(remote_cfg(server.url), Sample(response="x"))) == {"score": 1, "acc": True}


def test_boxed_remote_sends_only_the_box():
    with RewardServer([(200, 1.0, 0.0)]) as server:
        cfg = RewardConfig(rm_type="boxed_remote_rm", rm_url=server.url)
        asyncio.run(compute_reward(cfg, Sample(response="work \\boxed{42}", label="42")))
    assert server.requests[0]["response"] == "42"


def test_remote_retries_transient_errors_then_succeeds():
    with RewardServer([(503, "busy", 0.0), (500, "oops", 0.0), (200, 1.0, 0.0)]) as server:
        value = asyncio.run(
            post_reward(server.url, {"response": "x"}, timeout_s=2.0, max_retries=3, first_backoff_s=0.01)
        )
    assert value == 1.0
    assert len(server.requests) == 3


def test_remote_gives_up_after_max_retries_with_a_clear_error():
    with RewardServer([(500, "down", 0.0)]) as server:
        with pytest.raises(RemoteRewardError) as e:
            asyncio.run(post_reward(server.url, {}, timeout_s=2.0, max_retries=2, first_backoff_s=0.01))
    assert len(server.requests) == 3  # 1 attempt + 2 retries
    message = str(e.value)
    assert server.url in message and "3 time(s)" in message and "HTTP 500" in message


def test_remote_timeout_is_retried_and_named():
    with RewardServer([(200, 1.0, 1.0)]) as server:
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match="no answer within 0.2 s"):
            asyncio.run(post_reward(server.url, {}, timeout_s=0.2, max_retries=1, first_backoff_s=0.01))
        assert time.monotonic() - start < 1.5  # two 0.2 s waits, not two 1 s answers
    assert len(server.requests) == 2


def test_remote_client_error_is_not_retried():
    with RewardServer([(400, "bad payload", 0.0)]) as server:
        with pytest.raises(RemoteRewardError, match="rejected the request: HTTP 400"):
            asyncio.run(post_reward(server.url, {}, timeout_s=2.0, max_retries=3, first_backoff_s=0.01))
    assert len(server.requests) == 1


def test_remote_answer_must_be_a_number_or_object():
    with RewardServer([(200, "good job", 0.0)]) as server:
        with pytest.raises(RemoteRewardError, match="expected a number or a JSON object"):
            asyncio.run(post_reward(server.url, {}, timeout_s=2.0, max_retries=0))


def test_remote_unreachable_server_fails_after_retries():
    with RewardServer([(200, 1.0, 0.0)]) as server:
        url = server.url
    # The server is shut down: the port refuses connections.
    with pytest.raises(RemoteRewardError, match="connection failed"):
        asyncio.run(post_reward(url, {}, timeout_s=1.0, max_retries=1, first_backoff_s=0.01))


def test_per_sample_remote_without_url_is_a_user_error():
    sample = Sample(response="x", metadata={"rm_type": "remote_rm"})
    with pytest.raises(UserError, match="--rm-url"):
        asyncio.run(compute_reward(RewardConfig(rm_type="math"), sample))


# --- --custom-rm-path ---------------------------------------------------------------------------


HOOKS = '''
calls = []

async def length_reward(args, sample):
    calls.append(args.rm_type)
    return float(len(sample.response))

def sync_reward(args, sample):
    return {"score": 2.0}

async def rank_group(args, samples):
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
    ranks = [0.0] * len(samples)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks

async def wrong_length(args, samples):
    return [1.0]
'''


@pytest.fixture
def hooks(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(HOOKS)
    return path


def test_custom_rm_receives_the_reward_config_and_overrides_rm_type(hooks):
    cfg = RewardConfig(rm_type="math", custom_rm_path=f"{hooks}:length_reward")
    assert asyncio.run(compute_reward(cfg, Sample(response="abcd", label="1"))) == 4.0


def test_custom_rm_module_is_loaded_once(hooks):
    cfg = RewardConfig(rm_type="math", custom_rm_path=f"{hooks}:length_reward")
    assert asyncio.run(compute_group_rewards(cfg, [Sample(response="a"), Sample(response="bb")])) == [1.0, 2.0]
    asyncio.run(compute_reward(cfg, Sample(response="c")))
    # The hook's module-level list saw all three calls: the file was not re-executed per sample.
    assert len(_custom_rm(cfg.custom_rm_path).__globals__["calls"]) == 3


def test_custom_rm_may_be_synchronous(hooks):
    cfg = RewardConfig(custom_rm_path=f"{hooks}:sync_reward")
    assert asyncio.run(compute_reward(cfg, Sample(response="x"))) == {"score": 2.0}


def test_group_rm_calls_the_batched_hook_once_per_group(hooks):
    cfg = RewardConfig(group_rm=True, custom_rm_path=f"{hooks}:rank_group")
    group = [Sample(response="ccc"), Sample(response="a"), Sample(response="bb")]
    assert asyncio.run(compute_group_rewards(cfg, group)) == [2.0, 0.0, 1.0]


def test_group_rm_checks_the_number_of_rewards(hooks):
    cfg = RewardConfig(group_rm=True, custom_rm_path=f"{hooks}:wrong_length")
    with pytest.raises(UserError, match="list of 2 rewards"):
        asyncio.run(compute_group_rewards(cfg, [Sample(), Sample()]))


def test_custom_rm_without_group_rm_is_called_per_sample(hooks):
    cfg = RewardConfig(custom_rm_path=f"{hooks}:length_reward")
    assert asyncio.run(compute_group_rewards(cfg, [Sample(response="a"), Sample(response="abc")])) == [1.0, 3.0]


def test_missing_custom_rm_is_a_user_error_naming_the_flag(tmp_path):
    cfg = RewardConfig(custom_rm_path=f"{tmp_path / 'nope.py'}:fn")
    with pytest.raises(UserError, match="--custom-rm-path"):
        asyncio.run(compute_reward(cfg, Sample()))
