"""Generated outputs (and scored prompts) -> OpenAI's ``/v1/completions`` choices.

``completion_choices`` builds the choices of one prompt: its ``n`` samples, each with the prompt
before its text when the request asked for ``echo`` (and the prompt's logprobs, from a plain
forward: ``InferenceInterface.score``), or only the echoed prompt with ``max_tokens`` 0.
``completion_logprobs`` is OpenAI's legacy ``logprobs`` object: per token its text, logprob,
most likely alternatives (the request's ``logprobs`` of them, plus the token itself, keyed by
decoded text) and text offset; the prompt's first token has no logprob (null).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.rl.tokenizer import Tokenizer
from megatron.rl.wire import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    InferenceResponse,
    ScoreResponse,
    choice_extensions,
)

Alternatives = Sequence[tuple[int, float]]


def completion_logprobs(
    tokenizer: Tokenizer,
    tokens: Sequence[int],
    logprobs: Sequence[float | None],
    alternatives: Sequence[Alternatives | None] | None,
    offset: int = 0,
) -> CompletionLogprobs:
    """OpenAI's ``logprobs`` of ``tokens`` (``alternatives`` None: each token's own only), text
    offsets counted from ``offset``."""
    pieces = [tokenizer.decode([t]) for t in tokens]
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece)
    tops: list[dict[str, float] | None] = []
    for i, (piece, logprob) in enumerate(zip(pieces, logprobs)):
        if logprob is None:
            tops.append(None)
            continue
        top = {}
        for token, value in (alternatives[i] or ()) if alternatives is not None else ():
            top.setdefault(tokenizer.decode([token]), value)
        top.setdefault(piece, logprob)
        tops.append(top)
    return CompletionLogprobs(
        tokens=pieces, token_logprobs=list(logprobs), top_logprobs=tops, text_offset=offsets
    )


def completion_choices(
    body: CompletionRequest,
    first_index: int,
    prompt_ids: list[int],
    prompt_text: str,
    outs: list[InferenceResponse],
    scored: ScoreResponse | None,
    tokenizer: Tokenizer,
) -> list[CompletionChoice]:
    """The ``n`` choices of one prompt, numbered from ``first_index``: ``outs`` (none when
    ``max_tokens`` is 0), after the echoed prompt and its ``scored`` logprobs with ``echo``."""
    echoed = prompt_text if body.echo else ""
    head: CompletionLogprobs | None = None
    if body.echo and body.logprobs is not None:
        values: list[float | None] = [None]
        tops: list[Alternatives | None] = [None]
        if scored is not None:
            values += scored.logprobs
            tops += scored.top_logprobs
        head = completion_logprobs(tokenizer, prompt_ids, values, tops)
    choices = []
    for i in range(body.n):
        out = outs[i] if outs else None
        logprobs = head
        if body.logprobs is not None and out is not None:
            tail = completion_logprobs(
                tokenizer, out.tokens, out.logprobs, out.top_logprobs, len(echoed)
            )
            logprobs = tail if head is None else _joined(head, tail)
        if out is None:
            extensions = {"token_ids": [], "prompt_token_ids": prompt_ids, "policy_versions": []}
        else:
            extensions = choice_extensions(out)
        choices.append(
            CompletionChoice(
                index=first_index + i,
                text=echoed + (out.text if out is not None else ""),
                finish_reason=out.finish_reason if out is not None else "length",
                logprobs=logprobs,
                **extensions,
            )
        )
    return choices


def _joined(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=(head.top_logprobs or []) + (tail.top_logprobs or []),
        text_offset=(head.text_offset or []) + (tail.text_offset or []),
    )
