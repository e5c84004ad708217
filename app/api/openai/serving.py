"""OpenAI-compatible serving: completions and chat requests -> prompts + GenerationParams; the engine's generation
events -> OpenAI response bodies and server-sent-event chunks."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import jinja2
import orjson
from fastapi.responses import StreamingResponse

from app.api.common import finite
from app.api.front import Front
from app.api.inputs import check_limit
from app.api.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationFields, TextPart
from app.engine.results import ChoiceUpdate, PositionLogprobs, PromptLogprobs
from app.engine.work import GenerationParams
from app.errors import GenscoreError, InvalidRequestError, error_body
from sampler import SamplingParams

log = logging.getLogger("genscore.openai")

_UNSUPPORTED_CHAT_FIELDS = ("tools", "functions", "function_call", "audio", "prediction", "reasoning_effort",
                            "web_search_options")


# --- requests -> work ---------------------------------------------------------------------------------------------

@dataclass
class Work:
    """A validated request: its prompts (token ids), how to continue them, and how to answer."""

    prompts: list[list[int]]
    params: GenerationParams
    stream: bool
    include_usage: bool
    echo_texts: list[str] | None = None  # completions with echo: the prompt text each choice starts with
    prompt_params: list[str] = field(default_factory=list)  # each prompt's field, for the engine's 400s
    max_param: str = "max_tokens"  # the request's name for max_tokens


@dataclass
class _ChoiceState:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class OpenAIServing:
    """The logic behind /v1/completions and /v1/chat/completions."""

    def __init__(self, front: Front):
        self.front = front
        engine = self.engine = front.engine
        self.checks = front.checks
        self.loaded = engine.loaded
        self.settings = engine.settings
        self.tokens = engine.token_strings

    # --- shared validation ---------------------------------------------------------------------------------------
    def _sampling(self, request: GenerationFields) -> SamplingParams:
        return self.checks.sampling(
            request.logprobs_mode, request.logit_bias, temperature=1.0 if request.temperature is None else request.temperature,
            top_k=request.top_k, top_p=request.top_p, min_p=request.min_p)

    def _stop(self, request: GenerationFields) -> tuple[str, ...]:
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if any(s == "" for s in stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        return tuple(stop)

    def _check_common(self, request: GenerationFields, prompts: int) -> None:
        self.checks.model(request.model)
        if prompts * request.n > self.settings.max_choices:
            raise InvalidRequestError(
                f"{prompts} prompt(s) x n = {request.n} choices exceed the limit of {self.settings.max_choices}", "n")
        if request.stream_options is not None and not request.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")

    def _check_length(self, ids: list[int], max_tokens: int, param: str, max_param: str) -> None:
        self.checks.prompt(ids, param)
        if len(ids) + max_tokens > self.loaded.max_length:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.loaded.max_length} tokens, but {len(ids)} prompt "
                f"tokens + {max_tokens} completion tokens were requested; reduce the prompt or {max_param}", max_param)

    # --- /v1/completions -----------------------------------------------------------------------------------------
    def completion_work(self, request: CompletionRequest) -> Work:
        if request.suffix is not None:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise InvalidRequestError("best_of is not supported (only best_of = n)", "best_of")
        prompt = request.prompt
        if isinstance(prompt, str):
            raw: list = [prompt]
        elif not prompt:
            raise InvalidRequestError("prompt must not be an empty list", "prompt")
        elif isinstance(prompt[0], int):
            raw = [prompt]
        else:
            raw = list(prompt)
        self._check_common(request, len(raw))
        if request.logprobs is not None:
            self.checks.top_logprobs(request.logprobs, "logprobs")
        ids_to_report = tuple(request.logprob_token_ids or ())
        if ids_to_report:
            if request.logprobs is None:
                raise InvalidRequestError("logprob_token_ids needs logprobs (set logprobs to 0 or more)",
                                          "logprob_token_ids")
            self.checks.label_ids(ids_to_report, "logprob_token_ids")
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        check_limit(max_tokens, self.settings.max_generated_tokens, "max_tokens", "max_generated_tokens")
        prompts, echo_texts, prompt_params = [], [], []
        for i, item in enumerate(raw):
            param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
            prompt_params.append(param)
            if isinstance(item, str):
                ids = self.loaded.tokenizer(item, add_special_tokens=True)["input_ids"]
                echo_texts.append(item)
            else:
                self.checks.token_ids(item, param)
                ids = list(item)
                echo_texts.append(self.loaded.tokenizer.decode(ids) if request.echo else "")
            self._check_length(ids, max_tokens, param, "max_tokens")
            prompts.append(ids)
        params = GenerationParams(
            max_tokens=max_tokens, sampling=self._sampling(request), n=request.n, stop=self._stop(request),
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty, seed=request.seed,
            logprobs=request.logprobs, prompt_logprobs=request.echo and request.logprobs is not None,
            logprob_token_ids=ids_to_report)
        return Work(prompts, params, request.stream, bool(request.stream_options and request.stream_options.include_usage),
                    echo_texts if request.echo else None, prompt_params)

    async def completion(self, request: CompletionRequest):
        work = await self.front.on_tokenizer_thread(self.completion_work, request)
        events = self._events(work)  # a 400 from the engine comes here, before any answer starts
        response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if work.stream:
            return self._sse(self._completion_chunks(work, events, response_id, created))
        states, prompt_logprobs = await self._collect(work, events)
        choices = []
        for p, ids in enumerate(work.prompts):
            for c in range(work.params.n):
                state = states[p][c]
                echo_text = work.echo_texts[p] if work.echo_texts is not None else ""
                logprobs = None
                if work.params.logprobs is not None:
                    entries = list(zip(ids, prompt_logprobs[p])) if work.echo_texts is not None else []
                    entries += [(lp.token_id, lp) for lp in state.logprobs]
                    logprobs = self._completion_logprobs(entries, work.params, 0)
                choices.append({"index": p * work.params.n + c, "text": echo_text + "".join(state.text),
                                "logprobs": logprobs, "finish_reason": state.finish_reason})
        return {"id": response_id, "object": "text_completion", "created": created, "model": self.engine.model_name,
                "choices": choices, "usage": self._usage(work, states)}

    def _completion_logprobs(self, entries: list[tuple[int, PositionLogprobs | None]], params: GenerationParams,
                             offset: int) -> dict:
        """OpenAI's legacy logprobs object; text_offset counts characters into the choice's `text`."""
        tokens, token_logprobs, top_logprobs, text_offset, by_id = [], [], [], [], []
        for token_id, lp in entries:
            text = self.tokens.text(token_id)
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
            if lp is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                by_id.append(None)
                continue
            token_logprobs.append(finite(lp.value))
            top: dict[str, float] = {}
            for t, v in lp.top:  # best first; tokens that decode alike keep the best value under their shared key
                top.setdefault(self.tokens.text(t), finite(v))
            if all(t != token_id for t, _ in lp.top):
                top.setdefault(text, finite(lp.value))  # the chosen token is always listed
            top_logprobs.append(top)
            by_id.append({str(t): finite(v) for t, v in zip(params.logprob_token_ids, lp.requested)})
        out = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
               "text_offset": text_offset}
        if params.logprob_token_ids:
            out["token_id_logprobs"] = by_id
        return out

    async def _completion_chunks(self, work: Work, events: AsyncIterator, response_id: str,
                                 created: int) -> AsyncIterator[dict]:
        n = work.params.n
        offsets = [0] * (len(work.prompts) * n)
        echoed = [False] * len(offsets)
        prompt_logprobs: dict[int, list] = {}
        generated = 0

        def chunk(index: int, text: str, logprobs, finish_reason) -> dict:
            return self._choice_chunk(work, response_id, created, "text_completion", {
                "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})

        async for p, event in events:
            if isinstance(event, PromptLogprobs):
                prompt_logprobs[p] = event.positions
                continue
            index = p * n + event.choice
            generated += len(event.token_ids)
            entries: list = []
            text = event.text
            if work.echo_texts is not None and not echoed[index]:
                echoed[index] = True  # the prompt leads the choice's first chunk
                text = work.echo_texts[p] + text
                entries = list(zip(work.prompts[p], prompt_logprobs.get(p, [None] * len(work.prompts[p]))))
            logprobs = None
            if work.params.logprobs is not None:
                entries += [(lp.token_id, lp) for lp in event.logprobs or []]
                logprobs = self._completion_logprobs(entries, work.params, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs["tokens"])
            if text or logprobs is not None or event.finish_reason is not None:  # no empty chunks
                yield chunk(index, text, logprobs, event.finish_reason)
        if work.include_usage:
            yield self._usage_chunk(work, response_id, created, "text_completion", generated)

    # --- /v1/chat/completions ------------------------------------------------------------------------------------
    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The conversation as text, through the tokenizer's chat template."""
        tokenizer = self.loaded.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template, so it cannot serve chat requests; use /v1/completions", "messages")
        if not messages:
            raise InvalidRequestError("messages must hold at least one message", "messages")
        rendered = []
        for i, message in enumerate(messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, TextPart):
                        raise InvalidRequestError("only text content parts are supported",
                                                  f"messages[{i}].content[{j}]")
                    texts.append(part.text)
                content = "".join(texts)
            entry = {"role": message.role, "content": content or ""}
            if message.name is not None:
                entry["name"] = message.name
            rendered.append(entry)
        try:
            return tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}", "messages") from None

    def chat_work(self, request: ChatCompletionRequest) -> Work:
        for name in _UNSUPPORTED_CHAT_FIELDS:
            if getattr(request, name) is not None:
                raise InvalidRequestError(f"{name} is not supported", name)
        if request.tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is not supported", "tool_choice")
        if request.response_format not in (None, {"type": "text"}):
            raise InvalidRequestError("response_format is not supported (only {\"type\": \"text\"})", "response_format")
        if request.modalities not in (None, ["text"]):
            raise InvalidRequestError("only the text modality is supported", "modalities")
        self._check_common(request, 1)
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs to be true", "top_logprobs")
            self.checks.top_logprobs(request.top_logprobs, "top_logprobs")
        ids = self.loaded.tokenizer(self.render_chat(request.messages), add_special_tokens=False)["input_ids"]
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        check_limit(requested, self.settings.max_generated_tokens, param, "max_generated_tokens")
        max_tokens = (requested if requested is not None
                      else min(max(0, self.loaded.max_length - len(ids)), self.settings.max_generated_tokens))
        self._check_length(ids, max_tokens, "messages", param)
        params = GenerationParams(
            max_tokens=max_tokens, sampling=self._sampling(request), n=request.n, stop=self._stop(request),
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty, seed=request.seed,
            logprobs=(request.top_logprobs or 0) if request.logprobs else None)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return Work([ids], params, request.stream, include_usage, prompt_params=["messages"], max_param=param)

    async def chat(self, request: ChatCompletionRequest):
        work = await self.front.on_tokenizer_thread(self.chat_work, request)
        events = self._events(work)  # a 400 from the engine comes here, before any answer starts
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if work.stream:
            return self._sse(self._chat_chunks(work, events, response_id, created))
        states, _ = await self._collect(work, events)
        choices = []
        for c, state in enumerate(states[0]):
            logprobs = None
            if work.params.logprobs is not None:
                logprobs = {"content": self._chat_logprobs(state.logprobs), "refusal": None}
            choices.append({"index": c, "message": {"role": "assistant", "content": "".join(state.text),
                                                    "refusal": None},
                            "logprobs": logprobs, "finish_reason": state.finish_reason})
        return {"id": response_id, "object": "chat.completion", "created": created, "model": self.engine.model_name,
                "choices": choices, "usage": self._usage(work, states)}

    def _chat_logprobs(self, positions: list[PositionLogprobs]) -> list[dict]:
        text, raw = self.tokens.text, self.tokens.bytes
        return [{"token": text(lp.token_id), "logprob": finite(lp.value), "bytes": raw(lp.token_id),
                 "top_logprobs": [{"token": text(t), "logprob": finite(v), "bytes": raw(t)} for t, v in lp.top]}
                for lp in positions]

    async def _chat_chunks(self, work: Work, events: AsyncIterator, response_id: str,
                           created: int) -> AsyncIterator[dict]:
        generated = 0

        def chunk(index: int, delta: dict, logprobs, finish_reason) -> dict:
            return self._choice_chunk(work, response_id, created, "chat.completion.chunk", {
                "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

        for c in range(work.params.n):  # OpenAI opens every choice with the assistant role
            yield chunk(c, {"role": "assistant", "content": ""}, None, None)
        async for _, event in events:
            generated += len(event.token_ids)
            logprobs = None
            if work.params.logprobs is not None:
                logprobs = {"content": self._chat_logprobs(event.logprobs or []), "refusal": None}
            if not event.text and logprobs is None and event.finish_reason is None:
                continue  # text held back (a partial character or a possible stop string); no empty chunks
            delta = {"content": event.text} if event.text or event.finish_reason is None else {}
            yield chunk(event.choice, delta, logprobs, event.finish_reason)
        if work.include_usage:
            yield self._usage_chunk(work, response_id, created, "chat.completion.chunk", generated)

    # --- running the generator ---------------------------------------------------------------------------------------
    def _events(self, work: Work) -> AsyncIterator[tuple[int, PromptLogprobs | ChoiceUpdate]]:
        """Every prompt's events, as they come, tagged with the prompt's index. Leaving early cancels the rest.

        Each prompt goes to Engine.generate now, not when the events are first read: its refusal (a 400 for a
        prompt the memory budget could never hold) then comes before a streamed answer has sent its status."""
        streams = [self.engine.generate(ids, work.params, param, work.max_param)
                   for ids, param in zip(work.prompts, work.prompt_params, strict=True)]
        if work.params.max_tokens == 0 and not work.params.prompt_logprobs:
            return self._no_model_call(work)  # the streams are never read, so nothing is queued
        return self._merged(streams)

    @staticmethod
    async def _no_model_call(work: Work) -> AsyncIterator[tuple[int, ChoiceUpdate]]:
        for p in range(len(work.prompts)):  # nothing to compute: no model call at all
            for c in range(work.params.n):
                yield p, ChoiceUpdate(c, [], "", [], "length")

    @staticmethod
    async def _merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, PromptLogprobs | ChoiceUpdate]]:
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(p: int, stream: AsyncIterator) -> None:
            try:
                async for event in stream:
                    queue.put_nowait((p, event))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((p, exc))
            finally:
                queue.put_nowait((p, end))

        tasks = [asyncio.create_task(pump(p, stream)) for p, stream in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                p, event = await queue.get()
                if event is end:
                    remaining -= 1
                elif isinstance(event, BaseException):
                    raise event
                else:
                    yield p, event
        finally:
            for task in tasks:
                task.cancel()

    async def _collect(self, work: Work, events: AsyncIterator
                       ) -> tuple[list[list[_ChoiceState]], list[list[PositionLogprobs | None]]]:
        states = [[_ChoiceState() for _ in range(work.params.n)] for _ in work.prompts]
        prompt_logprobs: list[list] = [[None] * len(ids) for ids in work.prompts]
        async for p, event in events:
            if isinstance(event, PromptLogprobs):
                prompt_logprobs[p] = event.positions
                continue
            state = states[p][event.choice]
            state.token_ids += event.token_ids
            state.text.append(event.text)
            state.logprobs += event.logprobs or []
            if event.finish_reason is not None:
                state.finish_reason = event.finish_reason
        return states, prompt_logprobs

    def _usage(self, work: Work, states: list[list[_ChoiceState]]) -> dict:
        completion = sum(len(s.token_ids) for group in states for s in group)
        return self._usage_counts(work, completion)

    @staticmethod
    def _usage_counts(work: Work, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(ids) for ids in work.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _choice_chunk(self, work: Work, response_id: str, created: int, obj: str, choice: dict) -> dict:
        """One streamed chunk carrying one choice; `usage` is null on it when the client asked for usage at the end."""
        body = {"id": response_id, "object": obj, "created": created, "model": self.engine.model_name,
                "choices": [choice]}
        if work.include_usage:
            body["usage"] = None
        return body

    def _usage_chunk(self, work: Work, response_id: str, created: int, obj: str, completion_tokens: int) -> dict:
        return {"id": response_id, "object": obj, "created": created, "model": self.engine.model_name,
                "choices": [], "usage": self._usage_counts(work, completion_tokens)}

    @staticmethod
    def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
        """`data: {chunk}` events, then `data: [DONE]`; an error after the stream started becomes an error event."""

        async def body() -> AsyncIterator[bytes]:
            try:
                async for item in chunks:
                    yield b"data: " + orjson.dumps(item) + b"\n\n"
            except GenscoreError as exc:
                yield b"data: " + orjson.dumps(error_body(exc.message, exc.error_type, exc.param, exc.code)) + b"\n\n"
            except Exception:  # noqa: BLE001 - the status line is gone; the client still deserves a last word
                log.exception("stream failed")
                yield b"data: " + orjson.dumps(error_body("internal server error", "internal_server_error")) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

