"""What a request reports after a step: each sequence's output so far (cumulative), or only what is new since
its last report (delta form), with the text settled once it finishes.

While a sequence runs its text is the incremental detokenizer's; once it finishes, its first report decodes the
whole output once more (less a final EOS or stop id), so the final text is exactly one decode of the tokens,
unless a stop string already cut it. The delta form holds back running text that may still change (a stop string
that could still begin in it, see ``reportable_end``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dayzero.engine.request import CompletionOutput, Sequence, reportable_end


@dataclass(frozen=True)
class FinalText:
    """How a finished sequence's text is made: the tokenizer's decode and the ids that end a sequence."""

    decode: Callable[[list[int]], str]
    eos_ids: frozenset | set | tuple

    def settle(self, q: Sequence) -> None:
        """``q.text``: the running text, or once it finished, the exact text of one whole decode."""
        if not q.finished:
            q.text = q.detok.text if q.detok is not None else ""
        elif q.detok is not None:  # first report since it finished
            if not isinstance(q.stop_reason, str):  # a stop string already cut q.text
                ids = q.token_ids[q.num_prompt_tokens:]
                last = ids[-1] if ids else None
                ends_on_stop_id = q.finish_reason == "stop" and (last in self.eos_ids or last in q.params.stop_token_ids)
                q.text = self.decode(ids[:-1] if ends_on_stop_id else ids)
            q.detok = None


def cumulative_output(q: Sequence, texts: FinalText) -> CompletionOutput:
    texts.settle(q)
    want = q.params.logprobs is not None
    return CompletionOutput(
        q.index, q.text, q.output_ids, q.finish_reason, list(q.logprobs) if want else None, q.stop_reason,
        list(q.top_logprobs) if want else None,
    )


def delta_output(q: Sequence, texts: FinalText) -> CompletionOutput | None:
    """What is new in ``q`` since its last report; None when nothing is. The finished output's report completes
    the final text."""
    k = q.reported_tokens
    if k == q.num_output and (q.reported_finish or not q.finished):
        return None
    texts.settle(q)
    end = len(q.text) if q.finished else reportable_end(q.text, q.reported_chars, q.params.stop)
    text = q.text[q.reported_chars:end]
    q.reported_chars = max(end, q.reported_chars)
    q.reported_tokens = q.num_output
    q.reported_finish = q.finished
    want = q.params.logprobs is not None
    return CompletionOutput(
        q.index, text, q.token_ids[q.num_prompt_tokens + k:q.num_resolved], q.finish_reason,
        q.logprobs[k:] if want else None,
        q.stop_reason, q.top_logprobs[k:] if want else None,
    )
