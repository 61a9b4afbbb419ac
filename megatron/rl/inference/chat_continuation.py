"""Token-exact chat turns: what follows a generated assistant turn, without re-tokenizing it.

A chat episode alternates model turns and environment messages (tool results, user replies).
Rendering the whole conversation through the chat template and tokenizing it again before each
turn would re-tokenize the model's own earlier output, and decode -> encode is not the identity
(a token sequence the model sampled can come back as different, equally valid tokens), so the
trained tokens would not be the generated ones. Instead the history grows by tokens:

    history(t+1) = prompt(t) + generated(t) + environment_tokens(tokenizer, messages, generated(t))

``environment_tokens`` asks the template only for the text it puts *around* the new messages:
it renders a probe conversation ending in an assistant message, once without and once with the
new messages (and the next assistant's generation prompt), and keeps the difference. The text
the template puts after an assistant's content (its end-of-turn token and separator) is added
too, minus the stop token the model generated itself. Only that text is tokenized.
"""

from __future__ import annotations

from typing import Any

from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.wire import ChatMessage

PROBE_USER = "probe question"
PROBE_ASSISTANT = "PROBE_ANSWER_7f3a"
"""The probe conversation's contents: text no chat template rewrites."""


def environment_tokens(
    tokenizer: Any,
    new_messages: list[ChatMessage],
    generated: list[int],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The tokens that follow an assistant turn whose generated tokens are ``generated`` (its stop
    token included, if it stopped) when the environment answers with ``new_messages``: the
    template's end of the assistant turn (less the generated stop token), the new messages, and
    the generation prompt of the next assistant turn.

    Raises ``InvalidInferenceRequest`` naming the problem when the tokenizer has no chat template
    or the template does not render the conversation as an extension of its earlier rendering.
    """
    if not new_messages:
        raise InvalidInferenceRequest("environment_tokens: no new messages to render")
    if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "token_text"):
        raise InvalidInferenceRequest(
            f"messages: the tokenizer ({type(tokenizer).__name__}) has no chat template, so a "
            "chat turn cannot be rendered"
        )
    probe = [
        {"role": "user", "content": PROBE_USER},
        {"role": "assistant", "content": PROBE_ASSISTANT},
    ]
    added = [m.template_dict() for m in new_messages]
    try:
        before = tokenizer.apply_chat_template(probe, add_generation_prompt=False, tools=tools)
        after = tokenizer.apply_chat_template(
            probe + added, add_generation_prompt=True, tools=tools
        )
    except Exception as exc:  # jinja2 errors, the template's raise_exception, ...
        raise InvalidInferenceRequest(
            f"messages: the tokenizer's chat template cannot render them: {exc}"
        ) from None
    if not after.startswith(before) or PROBE_ASSISTANT not in before:
        raise InvalidInferenceRequest(
            "messages: the chat template does not render a conversation as an extension of its "
            "shorter prefix, so the environment's messages cannot be appended token-exactly"
        )
    closing = before[before.rindex(PROBE_ASSISTANT) + len(PROBE_ASSISTANT) :]
    if generated and generated[-1] in getattr(tokenizer, "stop_ids", [tokenizer.eos_id]):
        stop = tokenizer.token_text(generated[-1])
        if stop and closing.startswith(stop):
            closing = closing[len(stop) :]
    return tokenizer.encode_continuation(closing + after[len(before) :])
