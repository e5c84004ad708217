"""Text generation with continuous batching: a KV cache that sequences join and leave between decode steps; the
sampler samples and gives every returned logprob. Passive: the engine's scheduler says when to run a step, which
runs on the device thread."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor

import torch

import sampler
from app.engine.admission import admit, deadline_error, time_left
from app.engine.budget import LOGIT_ROWS_PER_CHUNK
from app.engine.decode_admission import Admission, Choice, PromptGroup, RowLimits, plan_admissions
from app.engine.detokenize import IncrementalDetokenizer
from app.engine.halves import Halves
from app.engine.results import ChoiceUpdate, PositionLogprobs, PromptLogprobs
from app.engine.sequences import eos_ids, held_back, position_params, score_positions, seeded_generator
from app.engine.work import GenerationParams
from app.errors import EngineError
from app.settings import Settings
from models import LoadedModel
from models.decoding import DecodeBatch, decode_step, drop_partial_step, merge, prefill, select_rows
from models.head import head_logits
from sampler import SamplingParams

log = logging.getLogger("genscore.generation")

_DONE = object()  # a prompt's last event: every choice finished


class Generator:
    """Owns the decode batch; `generate()` streams ChoiceUpdates for one prompt, `run_step()` advances them all."""

    def __init__(self, loaded: LoadedModel, settings: Settings, device: Executor,
                 on_tokens: Callable[[int, int], None] | None = None, on_work: Callable[[], None] | None = None):
        self.loaded = loaded
        self.max_batch_size = settings.max_batch_size
        self.max_batch_tokens = settings.max_batch_tokens
        self.max_cache_tokens = settings.max_cache_tokens
        self.max_rows_per_request = settings.max_rows_per_request
        # Whether `rows` decoding rows of final length `final` fit the memory budget while a prefill of
        # `prefill_rows` x `prefill_width` runs (the engine core sets it; alone, only max_cache_tokens bounds it).
        self.fits_memory: Callable[[int, int, int, int], bool] = lambda rows, final, prefill_rows, width: True
        self.max_queued_requests = settings.max_queued_requests
        self.retry_after_s = settings.retry_after_s
        # the worker decodes text with its own copy: a Rust tokenizer used from two threads can raise "Already borrowed"
        self._tokenizer = copy.deepcopy(loaded.tokenizer)
        self.stop_token_ids = frozenset(eos_ids(loaded))
        self._executor = device  # the app's one device thread, shared with the scoring batcher
        self._waiting: list[PromptGroup] = []
        self._admitting: list[Admission] = []  # admitted for the step in flight
        self._batch: DecodeBatch | None = None  # rows of self._rows, in order
        self._rows: list[Choice] = []
        self.steps = 0  # decode steps run (tests read it to see batching happen)
        # told (prompt tokens prefilled, tokens generated) after each step for callers, warm-up excluded (metrics)
        self._on_tokens = on_tokens
        self._counting = False
        self.on_work = on_work  # told when a prompt is queued (the engine core's wake-up)

    # --- lifecycle -----------------------------------------------------------------------------------------------
    async def warm_up(self) -> None:
        """Two greedy tokens with prompt logprobs: prefill, a decode step and the sampler, before the first caller."""
        ids = self.loaded.tokenizer("warm up", add_special_tokens=True)["input_ids"] or [self.loaded.pad_token_id]
        params = GenerationParams(max_tokens=2, sampling=SamplingParams(temperature=0.0), logprobs=1,
                                  prompt_logprobs=True)
        async for _ in self.generate(ids, params):
            pass
        self._counting = True

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything: rows decoding or prompts waiting."""
        return bool(self._rows or self._waiting)

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(rows, width) the decode cache may reach: the running rows x the longest final length (it is
        rectangular)."""
        return len(self._rows), max((self._final_length(c.group) for c in self._rows), default=0)

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        """Prompts waiting for a place in the decode batch."""
        return len(self._waiting)

    # --- callers ---------------------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: GenerationParams) -> AsyncIterator[PromptLogprobs | ChoiceUpdate]:
        """Queue one prompt; yield its PromptLogprobs (when asked) then ChoiceUpdates until every choice finished.

        Leaving the iteration early (or being cancelled) drops the prompt's choices from the batch.
        """
        # a bounded wait list (503 beyond it) and the request's deadline while waiting (504)
        deadline = admit(len(self._waiting), self.max_queued_requests, self.retry_after_s, "prompts to generate")
        group = PromptGroup(list(prompt_ids), params, asyncio.Queue(), unfinished=params.n)
        self._waiting.append(group)
        if self.on_work is not None:
            self.on_work()
        try:
            while True:
                if deadline is not None and group.started == 0:  # not admitted yet: the deadline applies
                    try:
                        item = await asyncio.wait_for(group.queue.get(), time_left(deadline))
                    except TimeoutError:
                        if group.started == 0:
                            raise deadline_error() from None
                        continue  # admitted just now: from here on it runs to the end
                else:
                    item = await group.queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            group.cancelled = True  # no-op when finished; otherwise the next step drops its rows
            if group in self._waiting:
                self._waiting.remove(group)

    # --- a step (event loop side) ---------------------------------------------------------------------------------
    def _final_length(self, group: PromptGroup) -> int:
        """The longest a row of this prompt can grow: prompt + max_tokens, within the model's length."""
        return min(len(group.prompt_ids) + group.params.max_tokens, self.loaded.max_length)

    def _admit(self, admit_new: bool) -> list[Admission]:
        """Choices of waiting prompts that join the batch at the next step (app/engine/decode_admission.py); none
        beside running rows unless `admit_new`."""
        self._waiting = [g for g in self._waiting if not g.cancelled]
        if not admit_new and self._rows:
            return []
        limits = RowLimits(self.max_batch_size, self.max_rows_per_request, self.max_batch_tokens,
                           self.max_cache_tokens, self.fits_memory)
        admitted = plan_admissions(self._waiting, [c.group for c in self._rows], self._final_length, limits)
        self._waiting = [g for g in self._waiting if g.started < g.params.n]
        return admitted

    async def run_step(self, admit_new: bool = True) -> None:
        """Admit what fits, then one step on the executor: prefill of the admitted prompts + one decode step."""
        admitted = self._admit(admit_new)
        self._admitting = admitted  # not yet in _rows: if the engine's loop dies now, these callers must hear it too
        try:
            events = await asyncio.get_running_loop().run_in_executor(self._executor, self._step, admitted)
        except Exception:  # noqa: BLE001 - every caller in the batch must hear about it
            log.exception("generation step failed")
            for group in {c.group for c in self._rows} | {a.group for a in admitted}:
                group.queue.put_nowait(EngineError("the model failed while generating"))
            self._rows, self._batch, self._admitting = [], None, []
            return
        self._admitting = []
        for group, event in events:
            group.queue.put_nowait(event)
        if self._on_tokens is not None and self._counting:
            generated = sum(len(e.token_ids) for _, e in events if isinstance(e, ChoiceUpdate))
            self._on_tokens(sum(len(a.group.prompt_ids) for a in admitted), generated)

    def fail_all(self, error: Exception) -> None:
        """Whatever ended the engine's loop, nobody may wait forever: every waiting and running prompt gets `error`."""
        for group in {c.group for c in self._rows} | set(self._waiting) | {a.group for a in self._admitting}:
            group.queue.put_nowait(error)
        self._rows, self._batch, self._waiting, self._admitting = [], None, [], []

    # --- one step (worker thread) ----------------------------------------------------------------------------------
    def _step(self, admitted: list[Admission]) -> list[tuple[PromptGroup, object]]:
        """Drop cancelled rows, prefill the admitted prompts, then one decode step for every running row."""
        events: list[tuple[PromptGroup, object]] = []
        keep = [i for i, c in enumerate(self._rows) if not c.group.cancelled]
        if len(keep) != len(self._rows):
            self._keep_rows(keep)
        if admitted:
            self._prefill_isolated(admitted, events)
        if self._rows:
            self._decode(events)
        return events

    def _prefill_isolated(self, groups: list[Admission], events: list) -> None:
        """Prefill the admitted prompts together; if that fails, split them, so only a prompt that fails on its own
        gets an error and neither the other newcomers nor the rows already decoding are touched."""

        def fail_alone(piece: list[Admission], exc: Exception) -> None:
            events.append((piece[0].group, EngineError("the model failed on this prompt")))

        for piece in (halves := Halves(groups, fail_alone, log, "prefill", "prompt")):
            staged: list[tuple[PromptGroup, object]] = []  # nothing is reported for an attempt that fails part-way
            try:
                self._prefill(piece, staged)
            except Exception as exc:  # noqa: BLE001 - the caller of a prompt that fails alone must hear about it
                halves.failed(piece, exc)
                continue
            events += staged

    def _keep_rows(self, keep: list[int]) -> None:
        self._rows = [self._rows[i] for i in keep]
        self._batch = select_rows(self._batch, keep) if keep else None

    @torch.inference_mode()
    def _prefill(self, admissions: list[Admission], events: list) -> None:
        model, device = self.loaded.model, self.loaded.device
        hidden, batch = prefill(model, self.loaded.plan, [a.group.prompt_ids for a in admissions], self.loaded.pad_token_id)  # [b, T, H]
        width = hidden.shape[1]
        last_logits = head_logits(self.loaded.plan, hidden[:, -1, :])  # [b, V]
        new_rows: list[int] = []  # batch row of each new choice
        new_choices: list[Choice] = []
        for row, (group, first, count) in enumerate(admissions):
            params = group.params
            if params.prompt_logprobs and first == 0:  # once per prompt, with its first choices
                start = width - len(group.prompt_ids)
                events.append((group, PromptLogprobs(self._prompt_logprobs(hidden[row, start:], group))))
            if params.max_tokens == 0:
                group.unfinished = 0
                for index in range(params.n):
                    events.append((group, ChoiceUpdate(index, [], "", [] if params.logprobs is not None else None,
                                                       "length")))
                events.append((group, _DONE))
                continue
            for index in range(first, first + count):
                new_choices.append(Choice(group, index, seeded_generator(params.seed, index, device),
                                          detokenizer=IncrementalDetokenizer(self._tokenizer)))
                new_rows.append(row)
        if not new_choices:
            return
        logits = last_logits.index_select(0, torch.tensor(new_rows, device=last_logits.device))  # [c, V]
        still_running = self._sample_and_report(new_choices, logits, events)
        if not still_running:
            return
        # each new row's buffers sized for its final length: no decode step reallocates the cache
        joined = select_rows(batch, [new_rows[i] for i in still_running],
                             [self._final_length(new_choices[i].group) for i in still_running])
        merged = merge(self._batch, joined)  # before touching self._rows: a failure here must leave them consistent
        self._rows += [new_choices[i] for i in still_running]
        self._batch = merged

    def _decode(self, events: list) -> None:
        """One decode step for every running row; a failing step is retried in halves until the failing row stands
        alone, so only its caller gets an error and every other row decodes on."""
        survivors = self._decode_isolated(self._rows, self._batch, events)
        self._rows = [choice for rows, _ in survivors for choice in rows]
        self._batch = None
        for _, batch in survivors:
            self._batch = merge(self._batch, batch)  # rows in the same order as self._rows

    @torch.inference_mode()
    def _decode_isolated(self, rows: list[Choice], batch: DecodeBatch, events: list
                         ) -> list[tuple[list[Choice], DecodeBatch]]:
        """Decode `rows` (the rows of `batch`, in order); returns the (rows, batch) pieces still running."""
        Piece = tuple[list[Choice], DecodeBatch]

        def take(piece: Piece, start: int, stop: int) -> Piece:
            rows, batch = piece
            return rows[start:stop], select_rows(batch, range(start, stop))

        def fail_alone(piece: Piece, exc: Exception) -> None:
            events.append((piece[0][0].group, EngineError("the model failed while generating")))

        survivors: list[Piece] = []
        for piece in (halves := Halves((rows, batch), fail_alone, log, "decode step", "row",
                                       size=lambda piece: len(piece[0]), take=take)):
            piece_rows, piece_batch = piece
            width = piece_batch.width
            next_tokens = torch.tensor([c.next_token for c in piece_rows], dtype=torch.long)  # [B]
            try:
                logits = decode_step(self.loaded.model, self.loaded.plan, piece_batch, next_tokens)  # [B, V]
            except Exception as exc:  # noqa: BLE001 - only the row that fails on its own may fail its caller
                drop_partial_step(piece_batch, width)
                halves.failed(piece, exc)
                continue
            self.steps += 1
            running = self._sample_and_report(piece_rows, logits, events)
            if not running:
                continue
            if len(running) != len(piece_rows):
                piece_rows, piece_batch = [piece_rows[i] for i in running], select_rows(piece_batch, running)
            survivors.append((piece_rows, piece_batch))
        return survivors

    def _sample_and_report(self, choices: list[Choice], logits: torch.Tensor, events: list) -> list[int]:
        """Sample one token per choice from logits [c, V], report it, and return the indices still running."""
        params = [c.group.params for c in choices]
        processed = self._penalized(logits, choices)  # [c, V]; the same tensor when no row has penalties
        tokens = sampler.sample(processed, [p.sampling for p in params], [c.generator for c in choices]).tolist()
        with_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: dict[int, PositionLogprobs] = {}
        if with_logprobs:
            # raw modes read the model's logits, processed modes the penalized ones the token was drawn from
            source = torch.stack([(processed if params[i].sampling.logprobs_mode.is_processed else logits)[i]
                                  for i in with_logprobs])  # [r, V]
            asked = [position_params(params[i], tokens[i]) for i in with_logprobs]
            for i, position in zip(with_logprobs, score_positions(source, asked)):
                logprobs[i] = position
        running = []
        for i, (choice, token) in enumerate(zip(choices, tokens)):
            finish = self._advance(choice, token)
            text = choice.text
            if finish is None:
                end = len(text) - held_back(text, choice.group.params.stop)
            else:
                end = len(text)
            delta = text[choice.sent:end] if end > choice.sent else ""
            choice.sent = max(choice.sent, end)
            update = ChoiceUpdate(choice.index, [token], delta, [logprobs[i]] if i in logprobs else None, finish)
            events.append((choice.group, update))
            if finish is None:
                running.append(i)
            else:
                choice.group.unfinished -= 1
                if choice.group.unfinished == 0:
                    events.append((choice.group, _DONE))
        return running

    def _advance(self, choice: Choice, token: int) -> str | None:
        """Append a sampled token; return the finish reason when the choice is done."""
        params = choice.group.params
        choice.output_ids.append(token)
        choice.next_token = token
        stopped_by_token = token in self.stop_token_ids
        out_of_length = (len(choice.output_ids) >= params.max_tokens
                         or len(choice.group.prompt_ids) + len(choice.output_ids) >= self.loaded.max_length)
        detokenizer = choice.detokenizer
        if not stopped_by_token:  # an end token is not part of the text
            detokenizer.add(token)
        if stopped_by_token or out_of_length:  # the last step: an unfinished character is text too
            detokenizer.flush()
        text = detokenizer.text  # = decode(output ids, end token excluded), grown by a few tokens' decode
        if params.stop:
            # a stop string can only have appeared where the text changed (its start may reach back into old text)
            search_from = max(0, len(choice.text) - max(len(s) for s in params.stop))
            hits = [pos for pos in (text.find(s, search_from) for s in params.stop) if pos >= 0]
            if hits:
                choice.text = text[:min(hits)]
                return "stop"
        choice.text = text
        if stopped_by_token:
            return "stop"
        return "length" if out_of_length else None

    def _penalized(self, logits: torch.Tensor, choices: list[Choice]) -> torch.Tensor:
        """Presence and frequency penalties over each choice's generated tokens (OpenAI's definition)."""
        rows = [i for i, c in enumerate(choices) if c.group.params.penalized and c.output_ids]
        if not rows:
            return logits
        out = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            p = choices[i].group.params
            counts = torch.bincount(torch.tensor(choices[i].output_ids, device=logits.device), minlength=vocab)[:vocab]
            out[i] -= counts.to(out.dtype) * p.frequency_penalty + (counts > 0).to(out.dtype) * p.presence_penalty
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, group: PromptGroup) -> list[PositionLogprobs | None]:
        """hidden [L, H] of one prompt -> the logprob of tokens 1..L-1, each read from the position before it."""
        ids = group.prompt_ids
        positions: list[PositionLogprobs | None] = [None]
        for start in range(0, len(ids) - 1, LOGIT_ROWS_PER_CHUNK):
            stop = min(start + LOGIT_ROWS_PER_CHUNK, len(ids) - 1)
            logits = head_logits(self.loaded.plan, hidden[start:stop])  # [c, V]
            asked = [position_params(group.params, ids[j + 1]) for j in range(start, stop)]
            positions += score_positions(logits, asked)
        return positions

