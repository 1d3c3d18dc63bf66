"""Engine-side sequences, request groups and the outputs the engine returns."""

from __future__ import annotations

import enum
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from .detokenizer import IncrementalDetokenizer
from .images import ImageSpan, page_salt
from .sampler import TokenCounts
from .sampling_params import SamplingParams
from .speculative import SpecStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None | "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    spec_decode: dict | None = None  # acceptance counts and rates under speculative decoding (SpecStats.as_dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool


class OutputIds(SequenceABC):
    """A live, read-only view of a sequence's output ids: O(1) to make and to ``len``, where slicing the
    token list copies it (75-100 us per row at 50k tokens, per copy)."""

    def __init__(self, tokens: list[int], start: int):
        self._tokens, self._start = tokens, start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._tokens[self._start + j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError("output index out of range")
        return self._tokens[self._start + i % len(self)]


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    """One generated completion (a request with ``n`` > 1 has ``n`` of them)."""

    def __init__(self, group: "RequestGroup", index: int, prompt_ids: list[int], params: SamplingParams,
                 detok: IncrementalDetokenizer, generator: torch.Generator | None):
        self.group, self.index, self.params = group, index, params
        self.seq_id = f"{group.request_id}#{index}"
        self.prompt_ids = list(prompt_ids)
        self.tokens = list(prompt_ids)  # prompt + output
        self.num_prompt = len(prompt_ids)
        self.num_computed = 0
        self.prefill_done = False
        self.status = Status.WAITING
        self.slot: int | None = None
        self.pages: list[int] = []
        self.page_hashes: list[bytes] = []  # chain hashes of full pages registered so far
        self.num_cached = 0  # tokens whose global rows came from the prefix cache
        self.detok = detok
        self.generator = generator
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.new_tokens: list[int] = []  # produced since the last output
        self.emitted_tokens = 0
        self.exact = False  # run every layer on every row for this sequence's prefill
        self.num_preemptions = 0
        self.output_view = OutputIds(self.tokens, self.num_prompt)  # ``tokens`` is only ever appended to
        self.counts: TokenCounts | None = None  # penalty state, made by the engine at the first sampling
        self.guide = None  # structured-output matcher (engine.guided.Guide), made at the first sampling
        self.draft: list[int] = []  # drafted tokens after the pending one, verified at the next step
        self.draft_probs = None  # [>= len(draft), V] what each draft was drawn from; None: the drafter's argmax
        self.ngram = None  # the n-gram drafter's index of this sequence's tokens
        self.mtp_next = None  # the MTP drafter's (output streams, logits of the first draft) after its last catch-up
        self.spec = SpecStats()  # speculative decoding's acceptance counts

    @property
    def output_ids(self) -> list[int]:
        """A copy of the output ids (O(length): for cumulative and final outputs, not per step)."""
        return self.tokens[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class RequestGroup:
    """A request: its prompt, parameters and ``n`` sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 arrival: float):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.arrival = arrival
        self.seqs: list[Sequence] = []
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False
        self.images: list[ImageSpan] = []  # image spans of the prompt, embedded once for all n sequences

    def page_salt(self, lo: int, hi: int) -> bytes:
        """Besides token ids, what decides the cached state of prompt positions [lo, hi): overlapping images."""
        return page_salt(self.images, lo, hi) if self.images else b""

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def make_output(self) -> RequestOutput:
        """The request's output after a step, shaped by ``params.output_kind``. ``delta_text`` and
        ``delta_token_ids`` always hold what is new; "delta" outputs copy nothing else, so a step's cost
        does not grow with the length of the generation."""
        delta_kind = self.params.output_kind == "delta"
        outs = []
        for s in self.seqs:
            n_out = s.num_output
            new_ids = s.tokens[s.num_prompt + s.emitted_tokens:]
            new_lps = None if s.logprobs is None else s.logprobs[s.emitted_tokens:]
            s.emitted_tokens = n_out
            delta = s.detok.take_delta(final=s.finished)
            if delta_kind:
                text, ids, lps = delta, new_ids, new_lps
            else:
                text, ids = s.detok.visible_text(final=s.finished), s.output_ids
                lps = None if s.logprobs is None else list(s.logprobs)
            outs.append(CompletionOutput(
                index=s.index, text=text, token_ids=ids, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                logprobs=lps, delta_text=delta, delta_token_ids=new_ids,
                spec_decode=s.spec.as_dict() if s.spec.num_drafts else None))
        prompt_lps = self.prompt_logprobs
        if delta_kind:  # sent once, with the first output
            prompt_lps, self.prompt_logprobs_sent = (None if self.prompt_logprobs_sent else prompt_lps), True
        elif prompt_lps is not None:
            prompt_lps = list(prompt_lps)
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, prompt_lps, outs, self.finished)
