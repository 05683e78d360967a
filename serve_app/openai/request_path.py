"""The path every generating or embedding request takes at an ingress replica, whatever its
route (completions, chat, responses, embeddings): its server span, its unknown fields, its
validation into a Prepared request (the chat template applied, tokenized, sampling
parameters checked: a 400 names the field), the engine client that runs it, and its record
in the metrics, the span and the app's traffic trace when it ends (or is turned away)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from engine.core.errors import InvalidParam
from engine.core.outputs import RequestOutput
from engine.model.generation_defaults import generation_defaults
from serve_app.config import AppArgs
from serve_app.ingress.api_policy import IGNORED_FIELDS_HEADER, IgnoredFields
from serve_app.ingress.lora_names import AdapterNames
from serve_app.observability import tracing
from serve_app.observability.telemetry import IngressMetrics
from serve_app.observability.trace_recorder import TraceRecorder
from serve_app.observability.traffic_trace import Row
from serve_app.openai import protocol as oai
from serve_app.openai.errors import OpenAIError
from serve_app.openai.logprobs_format import LogprobsFormatter
from serve_app.openai.prompts import PromptBuilder
from serve_app.openai.tool_calls import hold_to_tools, plan_tools
from serve_app.transport.engine_client import EngineClient
from serve_app.transport.streaming import Prepared

Body = oai.CompletionRequest | oai.ChatCompletionRequest


class RequestPath:
    def __init__(
        self,
        args: AppArgs,
        max_model_len: int,
        prompts: PromptBuilder,
        adapters: AdapterNames,
        client: EngineClient,
        metrics: IngressMetrics,
        tracer,
        trace: TraceRecorder | None = None,
    ) -> None:
        """`trace`: where the request's row goes when it ends (the app's traffic trace)."""
        self.args = args
        self.max_model_len = max_model_len
        self.prompts = prompts
        self.adapters = adapters
        self.client = client
        self.metrics = metrics
        self.tracer = tracer
        self.trace = trace
        self.ignored = IgnoredFields()
        # What a request that leaves a sampling field out gets: the checkpoint's values.
        self.defaults = generation_defaults(args.model, args.engine.generation_config)

    def span(
        self, path: str, model: str, stream: bool
    ) -> contextlib.AbstractContextManager[tracing.RequestSpan]:
        """A POST's server span (a context manager)."""
        attributes = {"http.request.method": "POST", "url.path": path}
        attributes |= {"dynabatch.stream": stream, "gen_ai.request.model": model}
        return tracing.request_span(self.tracer, f"POST {path}", attributes, kind="SERVER")

    def ignored_header(self, body: Any) -> dict[str, str]:
        """The response header naming the body's unknown fields (logged once each), or a 400
        naming the first."""
        ignored = body.ignored_fields()
        if ignored and self.args.api.unknown_fields == "reject":
            raise OpenAIError(400, f"{ignored[0]}: unknown or unsupported field", param=ignored[0])
        self.ignored.note(ignored)
        return {IGNORED_FIELDS_HEADER: ",".join(ignored)} if ignored else {}

    def prepare(self, endpoint: str, body: Body, lora: tuple[str, str] | None) -> Prepared:
        """`lora`: the LoRA adapter `body.model` names (name, directory), or None."""
        unsupported = body.unsupported()
        if unsupported is not None:
            raise OpenAIError(400, unsupported[1], param=unsupported[0])
        if body.num_sequences > self.args.replica_capacity:
            field = "n" if body.num_sequences == body.n else "best_of"
            message = (
                f"{field}: at most {self.args.replica_capacity} sequences per request here "
                "(an engine replica's capacity)"
            )
            raise OpenAIError(400, message, param=field)
        planned = None
        try:
            if isinstance(body, oai.ChatCompletionRequest):
                if len(body.messages) > self.args.api.max_messages:
                    raise InvalidParam(
                        "messages", f"messages: at most {self.args.api.max_messages} per request"
                    )
                planned = plan_tools(body.tools, body.tool_choice, self.args.api.tool_call_parser)
                prompt_ids = self.prompts.chat(body.messages, body.tools if planned else None)
                requested = body.requested_max_tokens
            else:
                prompt = body.single_prompt()
                prompt_ids = self.prompts.completion(prompt)
                requested = body.max_tokens
            if not prompt_ids:
                raise InvalidParam("prompt", "prompt: must not be empty")
            room = self.max_model_len - len(prompt_ids)
            if requested is not None:
                max_tokens = requested
            elif "max_tokens" in self.defaults:  # the model's, within the context
                max_tokens = min(int(self.defaults["max_tokens"]), room)
            else:  # OpenAI's: 16 for a completion, a chat's all the room left
                max_tokens = room if endpoint == "chat" else 16
            if max_tokens > room or room < 1:
                param = "messages" if endpoint == "chat" else "prompt"
                counts = (len(prompt_ids), max(max_tokens, 1))
                raise OpenAIError.too_long(param, self.max_model_len, *counts)
            params = body.sampling_params(max_tokens, self.defaults)
            if planned is not None:
                hold_to_tools(params, *planned, body.parallel_tool_calls is not False)
        except InvalidParam as exc:
            raise OpenAIError.bad_request(exc) from None
        formatter = None
        if params.logprobs is not None:
            formatter = LogprobsFormatter(self.prompts.tokenizer, endpoint == "chat")
        elif body.num_sequences > body.n:  # best_of ranks sequences by their log-probability
            params.logprobs = 0
        echo_text = None
        if getattr(body, "echo", False):  # completions only: the prompt as sent, or decoded
            echo_text = prompt if isinstance(prompt, str) else self.prompts.tokenizer.decode(prompt)
            params.prompt_logprobs = body.requested_logprobs()
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        return Prepared(
            oai.new_id(prefix),
            prompt_ids,
            params,
            endpoint,
            body.include_usage,
            body.continuous_usage,
            logprobs=formatter,
            n=body.n,
            echo_text=echo_text,
            tools=planned[0] if planned else None,
            reasoning=endpoint == "chat" and self.args.api.reasoning_parser == "think",
            lora=lora,
        )

    def record(
        self, prep: Prepared, span: tracing.RequestSpan, ttft: float, lasts: list[RequestOutput]
    ) -> None:
        """One request, whatever its number of sequences: the first's finish reason, the
        prompt once, every sequence's completion tokens."""
        reason = lasts[0].finish_reason
        prompt = lasts[0].num_prompt_tokens
        completion = sum(last.num_output_tokens for last in lasts)
        span.finish_reason = reason or "abort"
        span.set(
            {
                "dynabatch.request_id": prep.request_id,
                "http.response.status_code": 200,
                "gen_ai.usage.input_tokens": prompt,
                "gen_ai.usage.output_tokens": completion,
                "dynabatch.ttft_s": ttft,
            }
        )
        e2e = time.perf_counter() - prep.started
        self.metrics.completed(prompt, completion, reason, ttft, e2e)
        if self.trace is not None:
            cached = lasts[0].num_cached_tokens
            self.trace.add(self._row(prep, prompt, completion, cached, reason, ttft, e2e))

    def record_rejected(self, prep: Prepared) -> None:
        """A request turned away before it ran (429, 503): its row in the traffic trace, its
        output the max_tokens it asked for (the demand it stood for)."""
        if self.trace is not None:
            e2e = time.perf_counter() - prep.started
            prompt, asked = len(prep.prompt_token_ids), prep.params.max_tokens
            self.trace.add(self._row(prep, prompt, asked, 0, None, None, e2e, rejected=True))

    def _row(
        self,
        prep: Prepared,
        prompt: int,
        output: int,
        cached: int,
        reason: str | None,
        ttft: float | None,
        e2e: float,
        rejected: bool = False,
    ) -> Row:
        return {
            "request_id": prep.request_id,
            "arrival_unix": time.time() - e2e,
            "model": self.args.model_name,
            "adapter": prep.lora[0] if prep.lora else None,
            "prompt_len": prompt,
            "output_len": output,
            "cached_prompt_len": cached,
            "finish_reason": reason if reason or rejected else "abort",
            "ttft_s": ttft,
            "e2e_s": e2e,
            "rejected": rejected,
        }
