"""An agent for miles.rollout.generate_hub.agentic_tool_call.generate: chat, run the calculator, answer.

    miles train ... --custom-generate-function-path miles.rollout.generate_hub.agentic_tool_call.generate \
        --use-session-server --custom-agent-function-path docs/examples/calculator_agent.py:run_agent

It talks to the session's OpenAI-compatible endpoint like any chat client (any harness that speaks that
API works the same way), runs the tool calls itself and returns a reward: 1 when the final answer
contains the row's `metadata.answer`.
"""

from __future__ import annotations

import json

import aiohttp

from miles.rollout.tools.builtin import execute_tool

MAX_TURNS = 4
TIMEOUT = aiohttp.ClientTimeout(total=600)  # one reply of the engine; a stuck server must not hang the rollout
aborted = 0


async def run_agent(base_url, prompt, request_kwargs, metadata, **kw):
    messages = list(prompt)
    errors = 0
    content = ""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        for _ in range(MAX_TURNS):
            async with http.post(f"{base_url}/v1/chat/completions", json={"messages": messages, **request_kwargs}) as r:
                if r.status != 200:  # e.g. 503: the rollout has enough samples and aborted this one
                    break
                reply = (await r.json())["choices"][0]["message"]
            messages.append(reply)
            content = reply.get("content") or ""
            if not reply.get("tool_calls"):
                break
            for call in reply["tool_calls"]:
                result = await execute_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
                errors += result.startswith("Error: ")
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    answer = str(metadata.get("answer", ""))
    return {"reward": float(bool(answer) and answer in content), "tool_error_count": errors}


async def abort(cfg):
    """Called when the rollout aborts what is still running (it had enough groups)."""
    global aborted
    aborted += 1
