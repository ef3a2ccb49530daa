"""One request's way back to its caller: token events in, RequestOutput messages out.

Each output (sample or beam) gets its own incremental detokenizer with the request's stop
strings. Outputs that stream (n == best_of) send a message per token, tagged with their index;
best_of > n and beam search send one message per chosen output when the whole group ends,
because which outputs win is only known then. A None on the queue ends the stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from scheduler_svc.engine.request import RequestOutput, RequestStats, TokenLogprob
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence import FinishReason, Sequence
from scheduler_svc.sched.sequence_group import SequenceGroup
from scheduler_svc.sched.token_events import TokenEvent
from scheduler_svc.text.text_stream import TextStream
from scheduler_svc.text.tokenizer import Tokenizer

# Log fields of the caller's trace headers (scheduler_svc/api/generation_servicer.py log_fields).
TRACE_FIELDS = ("x_request_id", "x_correlation_id")


@dataclass(eq=False)
class RequestStream:
    group: SequenceGroup
    tokenizer: Tokenizer
    block_bytes: int
    queue: asyncio.Queue[RequestOutput | Exception | None] = field(default_factory=asyncio.Queue)
    aborted: bool = False  # by an Abort call: its blocks go at the next step
    abort_reason: str | None = None  # abort_call, deadline, cancelled
    trace: dict[str, str] = field(default_factory=dict)  # the caller's x-request-id / x-correlation-id
    owner: str = ""  # the caller that sent it (GenerationRequest.owner): the one whose Abort reaches it
    # Latency bookkeeping for the metrics (monotonic seconds).
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    scheduled: bool = False
    prompt_logprobs_sent: bool = False
    _texts: dict[int, TextStream] = field(default_factory=dict)
    _buffered: dict[int, str] = field(default_factory=dict)
    _logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    _matched: dict[int, str] = field(default_factory=dict)  # stop string that ended a sequence

    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.group.seqs)

    def stats(self) -> RequestStats:
        g = self.group
        return RequestStats(
            prefix_cache_hit_tokens=g.prefix_hit_tokens,
            num_preemptions=g.num_preemptions,
            num_swaps=g.num_swaps,
            swapped_bytes=g.swapped_blocks * self.block_bytes,
            spec_draft_tokens=sum(s.draft_state.drafted for s in g.seqs if s.draft_state is not None),
            spec_accepted_tokens=sum(s.draft_state.accepted for s in g.seqs if s.draft_state is not None),
        )

    def on_token(self, event: TokenEvent, scheduler: Scheduler) -> None:
        """Detokenize one event and send what the caller may see."""
        seq, reason = event.seq, event.finish_reason
        if seq.seq_id in self._matched:
            return  # a stop string ended it at an earlier token of this step (kept drafts)
        text_stream = self._texts.get(seq.seq_id)
        stopping = seq.stopping
        if text_stream is None:
            text_stream = TextStream(
                self.tokenizer,
                seq.prompt_token_ids,
                stopping.stop,
                stopping.include_stop_str_in_output,
                stopping.skip_special_tokens,
            )
            self._texts[seq.seq_id] = text_stream
        # A stop token ends the text: it is returned in token_ids, never shown.
        text = (
            ""
            if reason is FinishReason.STOP
            else text_stream.push(event.token_id, seq.num_output_tokens >= stopping.min_tokens)
        )
        if text_stream.matched_stop is not None:
            # Also when this token reached max_tokens: the stop string is why the text ends.
            if reason is None:
                scheduler.finish_seq(seq.seq_id, FinishReason.STOP_SEQUENCE)
                if 0 <= event.length < len(seq.token_ids):
                    del seq.token_ids[event.length :]  # the step's later tokens come after the stop
            reason = seq.finish_reason = FinishReason.STOP_SEQUENCE
        elif reason is not None:
            text += text_stream.flush()
        if reason is not None:
            del self._texts[seq.seq_id]
            self._matched[seq.seq_id] = text_stream.matched_stop or ""
        logprob = (TokenLogprob(event.token_id, event.logprob, event.top),) if seq.sampling.logprobs is not None else ()
        if self.group.streams:
            self.queue.put_nowait(self._output(seq, [event.token_id], text, reason, logprob))
        else:
            self._buffered[seq.seq_id] = self._buffered.get(seq.seq_id, "") + text
            self._logprobs.setdefault(seq.seq_id, []).extend(logprob)

    def finish(self) -> None:
        """The group ended: send the chosen outputs if they were held back, then close."""
        group = self.group
        if group.beam is not None:
            for index, hyp in enumerate(group.beam.pool[: group.sampling.n]):
                ids = list(hyp.output_token_ids)
                shown = ids[:-1] if hyp.finish_reason is FinishReason.STOP else ids
                self.queue.put_nowait(
                    RequestOutput(
                        request_id=group.request_id,
                        token_ids=ids,
                        text=self.tokenizer.decode(shown),
                        finish_reason=hyp.finish_reason,
                        prompt_tokens=len(group.seqs[0].prompt_token_ids),
                        completion_tokens=len(ids),
                        index=index,
                        cumulative_logprob=hyp.cumulative_logprob,
                        stats=self.stats(),
                        prompt_logprobs=self._prompt_logprobs_once(),
                        cached_tokens=group.prefix_hit_tokens,
                    )
                )
        elif not group.streams:
            for index, seq in enumerate(group.best()):
                out = self._output(
                    seq,
                    seq.output_token_ids,
                    self._buffered.get(seq.seq_id, ""),
                    seq.finish_reason,
                    tuple(self._logprobs.get(seq.seq_id, ())),
                )
                self.queue.put_nowait(dataclasses.replace(out, index=index))
        self.queue.put_nowait(None)

    def _prompt_logprobs_once(self) -> tuple[TokenLogprob, ...]:
        """The prompt's log-probabilities, on the first message of the stream only."""
        if self.prompt_logprobs_sent or self.group.sampling.prompt_logprobs is None:
            return ()
        self.prompt_logprobs_sent = True
        return tuple(TokenLogprob(t, lp, top) for t, lp, top in self.group.prompt_logprobs)

    def fail(self, error: Exception) -> None:
        self.queue.put_nowait(error)

    def _output(
        self,
        seq: Sequence,
        token_ids: list[int],
        text: str,
        reason: FinishReason | None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=token_ids,
            text=text,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            index=seq.index,
            cumulative_logprob=seq.cumulative_logprob,
            stats=self.stats() if reason is not None else None,
            logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs_once(),
            stop_sequence=self._matched.get(seq.seq_id, "") if reason is FinishReason.STOP_SEQUENCE else "",
            stop_token_id=seq.token_ids[-1] if reason is FinishReason.STOP else None,
            cached_tokens=self.group.prefix_hit_tokens,
        )
