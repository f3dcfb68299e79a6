"""The built-in engine as an HTTP server speaking the subset of SGLang's API that miles uses.

Routes (bodies and answers shaped like SGLang 0.5.23's, see shared/reference/scale-seams.md §1):

    POST /generate                       input_ids (one list or a batch of lists), sampling_params,
                                         return_logprob, rid -> {"text", "output_ids", "meta_info"}
    GET  /health                         200 while the engine's scheduler is alive
    GET  /health_generate                200 after a 1-token generation (503 while paused or failing)
    POST /pause_generation               in-flight requests return with finish "abort"; new ones wait
    POST /continue_generation
    POST /abort_request                  {"rid": prefix, "abort_all": bool}
    GET|POST /flush_cache
    GET  /model_info, /get_model_info, /server_info, /get_server_info, /v1/loads
    POST /begin_weight_update, /end_weight_update, /update_weight_version
    POST /update_weights_from_disk       {"model_path", "weight_version"}: every *.safetensors there
    POST /init_weights_update_group      {"master_address", "master_port", "rank_offset", "world_size",
                                          "group_name", "backend": "gloo"}
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name"}: one broadcast
                                         from rank 0 per tensor, in list order
    POST /destroy_weights_update_group
    POST /update_weights_from_tensor     {"serialized_named_tensors": [payload], "load_format": null}:
                                         handles to tensors in the sender's memory (shared memory on a
                                         CPU, CUDA IPC on a GPU), read by an allow-list unpickler
    POST /release_memory_occupation, /resume_memory_occupation   {"tags": [weights|kv_cache|cuda_graph] | null}:
                                         refused unless idle (release) or released (resume), as SGLang
    POST /weights_checker                {"action": "checksum"} -> {"checksum": sha256 of the weights}

`/update_weights_from_tensor` takes SGLang's colocated payload (miles.rollout.engine.tensor_ipc): it
never runs plain pickle on a body; a payload naming any global but torch's tensor rebuild functions,
tensor/storage classes and dtypes is refused with HTTP 400.

Run one by hand (binds 127.0.0.1; port 0 picks a free one and prints it):

    python -m miles.rollout.engine.server --hf-checkpoint runs/tiny-qwen3/hf --port 0

It also takes the SGLang server flags miles' SGLang launcher writes (`--model-path --host --port
--tp-size 1 --random-seed ...`, see SGLANG_FLAGS_TAKEN) and refuses any other SGLang flag by name, so
`--rollout-backend sglang --sglang-server-command "python -m miles.rollout.engine.server"` runs the
SGLang backend's whole code path (launch, health, router, client, weight updates, restarts) on a CPU
without SGLang.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from miles.rollout.engine.base import GenerateRequest, GenerateResponse, SamplingParams
from miles.rollout.engine.builtin import BuiltinEngine
from miles.rollout.engine.weight_transport import WeightReceiver

# Control calls kept for /server_info (the latest ones).
CONTROL_LOG_LEN = 1000
# How long /health_generate waits for its 1-token generation (SGLang: SGLANG_HEALTH_CHECK_TIMEOUT).
HEALTH_GENERATE_TIMEOUT_S = 20.0


def sglang_json(resp: GenerateResponse) -> dict[str, Any]:
    """A `GenerateResponse` as SGLang's `/generate` answer (logprobs as [logprob, token_id, text] triples)."""
    meta = dict(resp.meta_info)
    meta["weight_version"] = str(resp.weight_version)
    if resp.output_token_logprobs is not None:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(resp.output_token_logprobs, resp.output_ids)]
    if resp.input_token_logprobs is not None:
        meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(resp.input_token_logprobs, resp.input_token_ids or [])]
    return {"text": resp.text, "output_ids": resp.output_ids, "meta_info": meta}


def _requests_from_body(body: dict[str, Any]) -> tuple[list[GenerateRequest], bool]:
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("/generate needs input_ids (a list of token ids, or a list of such lists)")
    batched = isinstance(ids[0], list)
    rows = ids if batched else [ids]
    n = len(rows)

    def per_row(key: str, default: Any) -> list[Any]:
        value = body.get(key, default)
        if batched and isinstance(value, list) and key != "input_ids":
            if len(value) != n:
                raise ValueError(f"{key} has {len(value)} entries for {n} prompts")
            return value
        return [value] * n

    sps = per_row("sampling_params", {})
    rids = per_row("rid", None)
    logprob = per_row("return_logprob", False)
    start = per_row("logprob_start_len", None)
    if batched and any(r is not None for r in rids) and len(set(rids)) != n:
        raise ValueError("duplicate rid in one batch")
    reqs = [
        GenerateRequest(list(row), SamplingParams.from_dict(sp or {}), bool(lp), rid, st)
        for row, sp, rid, lp, st in zip(rows, sps, rids, logprob, start)
    ]
    return reqs, batched


class EngineServer:
    """Serves one `BuiltinEngine` on host:port from a background thread (its own asyncio loop)."""

    def __init__(self, engine: BuiltinEngine, *, host: str = "127.0.0.1", port: int = 0, tp_size: int = 1):
        self.engine = engine
        self.host, self.port = host, port
        self.tp_size = tp_size
        self.receiver = WeightReceiver(engine, tp_size=tp_size)
        self.released: set[str] = set()  # memory tags released, as SGLang tracks them
        # Control calls and health probes in arrival order ("/path" or "/path tag,tag"), shown by
        # /server_info: the order a weight sync and a colocated offload reach the engine.
        self.control_log: collections.deque[str] = collections.deque(maxlen=CONTROL_LOG_LEN)
        self._pending_version: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.started = time.time()
        self.generate_requests = 0  # prompts answered on /generate (health checks not counted)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> str:
        """Start serving; returns the URL once the socket is bound."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            from aiohttp import web

            # The router's registration probes workers with an HTTP/2 preface (gRPC detection) first;
            # aiohttp answers 400 and would log a traceback for each probe.
            logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            runner = web.AppRunner(self._app(), access_log=None)
            try:
                loop.run_until_complete(runner.setup())
                site = web.TCPSite(runner, self.host, self.port)
                loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]
            except BaseException as e:  # reported to start()'s caller
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())

        self._thread = threading.Thread(target=run, name="miles-engine-http", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the engine server did not bind {self.host}:{self.port} within {timeout:.0f} s")
        if errors:
            raise errors[0]
        return self.url

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    # ------------------------------------------------------------------ routes

    def _app(self):
        from aiohttp import web

        app = web.Application(client_max_size=1024**3)
        r = app.router
        r.add_route("*", "/generate", self._generate)
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health_generate)
        for path, fn in {
            "/pause_generation": self._pause,
            "/continue_generation": self._continue,
            "/abort_request": self._abort,
            "/begin_weight_update": self._begin,
            "/end_weight_update": self._end,
            "/update_weight_version": self._version,
            "/update_weights_from_disk": self._from_disk,
            "/init_weights_update_group": self._init_group,
            "/update_weights_from_distributed": self._from_distributed,
            "/destroy_weights_update_group": self._destroy_group,
            "/update_weights_from_tensor": self._from_tensor,
            "/release_memory_occupation": self._release,
            "/resume_memory_occupation": self._resume,
            "/weights_checker": self._checker,
        }.items():
            r.add_post(path, self._logged(path, fn))
        r.add_route("*", "/flush_cache", self._flush)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self._server_info)
        r.add_get("/v1/loads", self._loads)
        return app

    def _logged(self, path: str, fn):
        async def handler(request):
            if path not in ("/release_memory_occupation", "/resume_memory_occupation"):  # those log their tags
                self.control_log.append(path)
            return await fn(request)

        return handler

    async def _body(self, request) -> dict[str, Any]:
        raw = await request.read()
        return json.loads(raw) if raw else {}

    async def _blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    @staticmethod
    def _json(data: Any, status: int = 200):
        from aiohttp import web

        return web.json_response(data, status=status)

    def _fail(self, message: str, status: int = 400):
        return self._json({"success": False, "message": message, "error": {"message": message}}, status)

    async def _generate(self, request):
        try:
            reqs, batched = _requests_from_body(await self._body(request))
            futures = [self.engine.submit(r) for r in reqs]
        except (ValueError, TypeError, KeyError) as e:
            return self._fail(str(e))
        responses = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        self.generate_requests += len(responses)
        out = [sglang_json(r) for r in responses]
        return self._json(out if batched else out[0])

    async def _health(self, request):
        ok = self.engine.health()["ok"]
        return self._json({"status": "ok" if ok else "unhealthy"}, 200 if ok else 503)

    async def _health_generate(self, request):
        self.control_log.append("/health_generate")
        if self.engine._paused or self.engine._updating:
            return self._fail("paused", 503)
        req = GenerateRequest([0], SamplingParams(temperature=0, max_new_tokens=1), rid=f"HEALTH_CHECK_{time.time_ns()}")
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.submit(req)), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure is an unhealthy engine
            return self._fail(f"health generation failed: {e!r}", 503)
        return self._json({"status": "ok"})

    async def _pause(self, request):
        await self._blocking(self.engine.pause_generation)
        return self._json({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request):
        self.engine.continue_generation()
        return self._json({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort(self, request):
        body = await self._body(request)
        self.engine.abort_request(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return self._json({})

    async def _flush(self, request):
        self.engine.flush_cache()
        return self._json("Cache flushed.")

    async def _begin(self, request):
        try:
            await self._blocking(self.engine.begin_weight_update)
        except (RuntimeError, TimeoutError) as e:
            return self._fail(str(e))
        return self._json({"success": True, "message": "ok"})

    async def _version(self, request):
        body = await self._body(request)
        self._pending_version = int(body["new_version"])
        if not self.engine._updating:
            self.engine.weight_version = self._pending_version
            self._pending_version = None
        return self._json({"success": True, "message": "ok"})

    async def _end(self, request):
        body = await self._body(request)
        version = body.get("weight_version", self._pending_version)
        self._pending_version = None
        try:
            self.engine.end_weight_update(self.engine.weight_version if version is None else int(version))
        except RuntimeError as e:
            return self._fail(str(e))
        return self._json({"success": True, "message": "ok"})

    async def _call_update(self, fn, body: dict[str, Any]):
        import pickle

        try:
            await self._blocking(fn, body)
        except (RuntimeError, ValueError, KeyError, FileNotFoundError, TimeoutError, pickle.UnpicklingError) as e:
            return self._fail(f"{type(e).__name__}: {e}")
        if body.get("weight_version") is not None:
            self._pending_version = int(body["weight_version"])
        return self._json({"success": True, "message": "Succeeded to update model weights."})

    async def _from_disk(self, request):
        return await self._call_update(self.receiver.update_from_disk, await self._body(request))

    async def _init_group(self, request):
        return await self._call_update(self.receiver.init_group, await self._body(request))

    async def _from_distributed(self, request):
        return await self._call_update(self.receiver.update_from_distributed, await self._body(request))

    async def _destroy_group(self, request):
        return await self._call_update(self.receiver.destroy_group, await self._body(request))

    async def _from_tensor(self, request):
        return await self._call_update(self.receiver.update_from_tensor, await self._body(request))

    async def _release(self, request):
        from miles.rollout.engine.base import memory_tags

        try:
            tags = memory_tags((await self._body(request)).get("tags"))
        except ValueError as e:
            return self._fail(str(e))
        self.control_log.append(f"/release_memory_occupation {','.join(tags)}")
        h = self.engine.health()
        if h["running"] or (h["waiting"] and not h["paused"]):  # SGLang asserts the same
            return self._fail("release_memory_occupation should be called only when server is idle.")
        await self._blocking(self.engine.release_memory_occupation, tags)
        self.released.update(tags)
        return self._json(None)

    async def _resume(self, request):
        from miles.rollout.engine.base import memory_tags

        try:
            tags = memory_tags((await self._body(request)).get("tags"))
        except ValueError as e:
            return self._fail(str(e))
        self.control_log.append(f"/resume_memory_occupation {','.join(tags)}")
        if not set(tags) <= self.released:  # SGLang's scheduler raises KeyError (and dies) here
            return self._fail(f"memory tag {sorted(set(tags) - self.released)[0]!r} is not released")
        await self._blocking(self.engine.resume_memory_occupation, tags)
        self.released.difference_update(tags)
        return self._json(None)

    async def _checker(self, request):
        return self._json({"success": True, "checksum": await self._blocking(self.engine.get_weights_checksum)})

    async def _model_info(self, request):
        return self._json(
            {
                "model_path": str(self.engine.hf_dir),
                "tokenizer_path": str(self.engine.hf_dir),
                "served_model_name": str(self.engine.hf_dir),
                "is_generation": True,
                "weight_version": str(self.engine.weight_version),
                "model_type": getattr(self.engine.model.config, "model_type", None),
                "architectures": getattr(self.engine.model.config, "architectures", None),
            }
        )

    async def _server_info(self, request):
        return self._json(
            {
                "model_path": str(self.engine.hf_dir),
                "tokenizer_path": str(self.engine.hf_dir),
                "host": self.host,
                "port": self.port,
                "tp_size": self.tp_size,
                "dp_size": 1,
                "max_running_requests": self.engine.max_batch_size,
                "startup_time": self.started,
                "version": "miles-builtin",
                "internal_states": [self.engine.health()],
                "generate_requests": self.generate_requests,
                "pid": os.getpid(),
                "released_memory": sorted(self.released),
                "control_calls": list(self.control_log),
            }
        )

    async def _loads(self, request):
        h = self.engine.health()
        return self._json({"loads": [{"dp_rank": 0, "num_running_reqs": h["running"], "num_waiting_reqs": h["waiting"]}]})


# SGLang server flags this server takes, so `--rollout-backend sglang --sglang-server-command "python -m
# miles.rollout.engine.server"` runs it from the argv miles builds for SGLang (launch.server_argv).
# Any other SGLang flag is refused by name: the built-in engine would silently not honour it.
SGLANG_FLAGS_TAKEN = {
    "--model-path": "the model directory (same as --hf-checkpoint)",
    "--host": "the address to bind",
    "--port": "the port (0 = a free one)",
    "--random-seed": "the engine's seed (same as --seed)",
    "--max-running-requests": "the largest decode batch (same as --max-batch-size)",
    "--device": "cpu or cuda",
    "--tp-size": "simulated TP ranks: the model is not sharded, but the engine joins a weight broadcast group with this many ranks and takes one tensor payload per rank, checking every copy agrees",
    "--nccl-port": "accepted and unused: one process has no tensor-parallel group",
    "--skip-server-warmup": "accepted: this server never warms up",
    "--enable-memory-saver": "accepted: /release_memory_occupation and /resume_memory_occupation are always served",
    "--log-level": "this server's log level",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m miles.rollout.engine.server",
        description=__doc__.split("\n")[0] + " It also takes these SGLang server flags: " + ", ".join(SGLANG_FLAGS_TAKEN) + ".",
    )
    ap.add_argument("--hf-checkpoint", "--model-path", dest="model", required=True, help="Hugging Face model directory.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=256)
    ap.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tp-size", type=int, default=1, help=SGLANG_FLAGS_TAKEN["--tp-size"])
    ap.add_argument("--nccl-port", type=int, help=SGLANG_FLAGS_TAKEN["--nccl-port"])
    ap.add_argument("--skip-server-warmup", action="store_true", help=SGLANG_FLAGS_TAKEN["--skip-server-warmup"])
    ap.add_argument("--enable-memory-saver", action="store_true", help=SGLANG_FLAGS_TAKEN["--enable-memory-saver"])
    ap.add_argument("--log-level", default="warning")
    args, unknown = ap.parse_known_args(argv)
    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("--")]
    if flags or unknown:
        name = flags[0] if flags else unknown[0]
        ap.error(
            f"{name} is an SGLang server flag the built-in engine server does not implement; drop the matching "
            f"--sglang-{name[2:]} option, or point --sglang-server-command at a real SGLang server"
        )
    if args.tp_size < 1:
        ap.error(f"--tp-size {args.tp_size}: an engine has at least one TP rank")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    # A standalone server (an OPD teacher, a stand-in for SGLang) knows nothing of what else runs on the
    # machine: one torch thread unless OMP_NUM_THREADS says otherwise (torch's own default, every core,
    # would oversubscribe the run beside it). Ray runs set OMP_NUM_THREADS=1 for every actor's children.
    threads = os.environ.get("OMP_NUM_THREADS") or "1"
    if not threads.isdigit() or int(threads) < 1:
        print(f"OMP_NUM_THREADS={threads!r}: the engine server's torch threads must be a positive integer.", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(int(threads))
    server = EngineServer(
        BuiltinEngine(args.model, device=args.device, max_batch_size=args.max_batch_size, seed=args.seed),
        host=args.host, port=args.port, tp_size=args.tp_size,
    )  # fmt: skip
    print(server.start(), flush=True)

    def summary_and_exit(signum, frame) -> None:
        # One line a person (or a test) can read in the server's log after the run stops it.
        h = server.engine.health()
        print(
            f"[miles] engine server {server.url} stopping: {server.generate_requests} /generate requests, "
            f"{h['generated_tokens']} tokens, weight version {h['weight_version']}",
            flush=True,
        )
        os._exit(0)

    signal.signal(signal.SIGTERM, summary_and_exit)
    threading.Event().wait()


if __name__ == "__main__":
    main()
