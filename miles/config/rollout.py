"""Rollout options: the engine that generates responses, sampling, lengths and weight sync."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import Derived, option
from miles.errors import UserError


@dataclass
class RolloutConfig:
    hf_checkpoint: str | None = option(
        None, help="Hugging Face model directory: tokenizer, config and the rollout engines' first weights.",
        in_eval=True,
    )
    rollout_backend: Literal["builtin", "sglang"] = option(
        "builtin",
        help="Rollout engine: builtin (batched, KV-cached torch decoding; any machine) or sglang (GPU servers behind sglang-router).",
        in_eval=True,
    )
    rollout_temperature: float = option(
        1.0,
        help="Sampling temperature for training rollouts (0 = greedy). The trainer divides its logits by the "
        "same temperature (1 when greedy), so its log-probs, entropy and KL score the policy the engine sampled from.",
        in_eval=True,
    )
    rollout_top_p: float = option(1.0, help="Nucleus sampling: keep the smallest token set with this total probability.", in_eval=True)
    rollout_top_k: int = option(-1, help="Keep only the k most likely tokens; -1 disables.", in_eval=True)
    rollout_max_context_len: int | None = option(None, help="Maximum prompt + response tokens; unset = no limit.", in_eval=True)
    rollout_max_prompt_len: int | None = option(
        help="Prompts longer than this many tokens are dropped from the dataset.",
        derived=Derived(
            "--rollout-max-context-len − 1 when that is set, else no limit",
            lambda c: None if c.rollout.rollout_max_context_len is None else c.rollout.rollout_max_context_len - 1,
        ),
        in_eval=True,
    )
    rollout_max_response_len: int = option(1024, help="Maximum new tokens per response; longer responses are truncated.", in_eval=True)
    rollout_stop: list[str] | None = option(None, help="Stop strings (repeat the flag for several); the stop string is kept in the response.", in_eval=True)
    rollout_stop_token_ids: list[int] | None = option(
        None, help="Token ids that end a response, in addition to the tokenizer's EOS (repeat the flag for several).",
        in_eval=True,
    )
    rollout_skip_special_tokens: bool = option(False, help="Drop special tokens when decoding responses to text.", in_eval=True)
    rollout_shuffle: bool = option(False, help="Shuffle the prompt dataset at every epoch (seeded by --rollout-seed).")
    rollout_seed: int = option(42, help="Seed for prompt shuffling and sampling.", in_eval=True)
    over_sampling_batch_size: int | None = option(
        help="Prompt groups submitted per rollout when dynamic sampling may drop some.",
        derived=Derived("equal to --rollout-batch-size", lambda c: c.data.rollout_batch_size),
    )
    dynamic_sampling_filter_path: str | None = option(
        None,
        help="Group filter `fn(args, group) -> FilterResult`, e.g. miles.rollout.filters.check_reward_nonzero_std.",
    )
    custom_generate_function_path: str | None = option(
        None,
        help=(
            "The function that makes the samples of one prompt sample, for training rollouts and eval: module.fn or "
            "file.py:fn naming `async fn(input: GenerateInput) -> GenerateOutput` "
            "(miles.rollout.generate_hub.types); unset = miles.rollout.generate_hub.single_turn.generate, one engine "
            "request per sample."
        ),
        in_eval=True,
    )
    rollout_function_path: str | None = option(
        None,
        help=(
            "Replace the whole training rollout (drawing prompts, generation, over-sampling, filters, aborts): module.fn "
            "or file.py:fn naming `async fn(input: RolloutFnInput) -> RolloutFnOutput` "
            "(miles.rollout.generate_hub.types), which returns --rollout-batch-size x --n-samples-per-prompt samples as "
            "prompt groups; samples without a reward are scored by --rm-type / --custom-rm-path. Eval is unchanged."
        ),
    )
    generate_max_turns: int = option(
        16,
        help="Most engine calls per trajectory of miles.rollout.generate_hub.multi_turn.generate (each turn gets "
        "--rollout-max-response-len new tokens; --rollout-max-context-len bounds the whole trajectory).",
        in_eval=True,
    )
    generate_tool_call_parser: Literal["qwen25"] = option(
        "qwen25",
        help="How multi-turn generation reads the model's tool calls: qwen25 = Qwen2.5/Qwen3's "
        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> blocks (SGLang's parser name).",
        in_eval=True,
    )
    generate_tool_specs_path: str | None = option(
        None,
        help="The tools multi-turn generation offers: module.attr, file.py:attr or a .json file holding a list of "
        "OpenAI tool dicts; given to the chat template of prompts whose row has no --tool-key tools, and calls to "
        "other tools are answered with an error. Unset = the row's --tool-key tools, or any name the executor takes.",
        in_eval=True,
    )
    generate_execute_tool_function_path: str | None = option(
        None,
        help="Runs multi-turn generation's tool calls: module.fn or file.py:fn naming `async fn(name: str, params: "
        "dict) -> str`; unset = miles.rollout.tools.builtin.execute_tool (calculator, and python in a limited "
        "subprocess).",
        in_eval=True,
    )
    custom_agent_function_path: str | None = option(
        None,
        help="The agent of miles.rollout.generate_hub.agentic_tool_call.generate: module.fn or file.py:fn naming "
        "`async fn(base_url, prompt, request_kwargs, metadata, **kw) -> dict | None`, which talks to the session's "
        "OpenAI-compatible {base_url}/v1/chat/completions; a returned `reward` is trained on, the rest joins the "
        "sample's metadata.",
        in_eval=True,
    )
    use_session_server: bool = option(
        False,
        help="Serve the OpenAI-compatible per-session chat endpoint that agentic generation's agents call (on "
        "127.0.0.1, a free port); miles renders and tokenizes, so the trained tokens are the engine's.",
        in_eval=True,
    )
    update_weight_buffer_size: int = option(
        512 * 1024**2, help="Bytes per bucket when sending new weights from the trainer to the rollout engines."
    )
    update_weight_transfer_mode: Literal["broadcast", "disk", "tensor"] = option(
        "broadcast",
        help=(
            "How engine servers get new weights from the trainer's source rank: broadcast (a gloo/NCCL group with "
            "the engines, bucket by bucket), disk (safetensors shards under the run directory, then "
            "update_weights_from_disk) or tensor (SGLang's colocated path, update_weights_from_tensor: handles to "
            "each bucket in the source's memory, shared memory on a CPU and CUDA IPC on a GPU; engines on the "
            "source's node only, and on GPUs one engine colocated with it). The in-process engine takes tensors directly."
        ),
    )
    sglang_router_policy: Literal["round_robin", "cache_aware", "power_of_two", "random"] = option(
        "round_robin",
        help=(
            "sglang-router's policy for spreading /generate over engine servers (upstream leaves the router's "
            "cache_aware default, which at low concurrency sends everything to one engine)."
        ),
    )
    rollout_max_batch_size: int = option(
        256, help="Largest batch of sequences the built-in engine decodes at once.",
        in_eval=True,
    )
    rollout_dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32",
        help="Weights, activations and KV cache of the built-in engine. float32 gives the trainer's log-probs "
        "(train/train_rollout_logprob_abs_diff ~1e-7); bfloat16 and float16 halve the memory, with log-probs off by "
        "their rounding. SGLang servers take --sglang-dtype.",
        in_eval=True,
    )
    sglang_server_concurrency: int = option(
        512,
        help="Requests in flight per SGLang server (--rollout-backend sglang); the rollout manager holds the rest back in order.",
    )

    def check(self, rollout_batch_size: int, sft: bool = False) -> None:
        """Reject options the rollout function would silently ignore: it replaces the built-in rollout,
        its over-sampling and its filter (so does `--loss-type sft_loss`'s rollout, which generates
        nothing). Reject multi-turn and agentic options the generate function in use would ignore."""
        self._check_generate_options()
        if sft and not self.rollout_function_path:
            self._check_sft_options(rollout_batch_size)
        if not self.rollout_function_path:
            return
        if self.dynamic_sampling_filter_path:
            raise UserError(
                "--dynamic-sampling-filter-path is not applied with --rollout-function-path (the rollout function replaces "
                "the built-in rollout and its filter); filter inside the function or drop one of them.",
                option="--dynamic-sampling-filter-path",
            )
        if self.over_sampling_batch_size != rollout_batch_size:
            raise UserError(
                "--over-sampling-batch-size is not used with --rollout-function-path (the function draws its own prompts); drop it.",
                option="--over-sampling-batch-size",
            )

    def _check_sft_options(self, rollout_batch_size: int) -> None:
        if self.dynamic_sampling_filter_path:
            raise UserError(
                "--dynamic-sampling-filter-path filters generated groups, and --loss-type sft_loss trains on the data's "
                "conversations without generating; drop the filter.",
                option="--dynamic-sampling-filter-path",
            )
        if self.over_sampling_batch_size != rollout_batch_size:
            raise UserError(
                "--over-sampling-batch-size is not used with --loss-type sft_loss (each step takes --rollout-batch-size "
                "conversations, nothing is dropped); drop it.",
                option="--over-sampling-batch-size",
            )

    def _check_generate_options(self) -> None:
        if self.generate_max_turns < 1:
            raise UserError(f"--generate-max-turns {self.generate_max_turns} must be at least 1.", option="--generate-max-turns")
        path = self.custom_generate_function_path or ""
        set_ = [
            flag for flag, value in (
                ("--generate-tool-specs-path", self.generate_tool_specs_path),
                ("--generate-execute-tool-function-path", self.generate_execute_tool_function_path),
                ("--custom-agent-function-path", self.custom_agent_function_path),
                ("--use-session-server", self.use_session_server),
            ) if value
        ]
        if set_ and not path:
            raise UserError(
                f"{set_[0]} is not used by the default single-turn generate function; add --custom-generate-function-path "
                "miles.rollout.generate_hub.multi_turn.generate (tools) or ...agentic_tool_call.generate (agents), or drop it.",
                option=set_[0],
            )
        if path.endswith("agentic_tool_call.generate"):
            if not self.custom_agent_function_path:
                raise UserError(
                    f"--custom-generate-function-path {path} needs --custom-agent-function-path naming the agent "
                    "(`async fn(base_url, prompt, request_kwargs, metadata, **kw)`).",
                    option="--custom-agent-function-path",
                )
            if not self.use_session_server:
                raise UserError(
                    f"--custom-generate-function-path {path} needs --use-session-server (its agent talks to the session endpoint).",
                    option="--use-session-server",
                )
