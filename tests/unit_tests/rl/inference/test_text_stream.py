"""``TextStream``: token deltas whose text joins to the final text, never half a character, and
stop strings that cut the text before them at the token that completed them."""

from __future__ import annotations

import pytest

from megatron.rl.inference.text_stream import TextStream
from megatron.rl.tokenizer import CharTokenizer


class BytePieces:
    """A tokenizer whose tokens are single UTF-8 bytes (a character may take several)."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def pushed(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.push(i) for i in ids]


@pytest.mark.parametrize(
    "text, stop, deltas, final, stopped",
    [
        pytest.param("0123456789", [], list("0123456789"), "0123456789", False, id="no-stop"),
        pytest.param("0123456789", ["34"], ["", "0", "1", "2", ""], "012", True, id="stop-cut"),
        pytest.param("0123", ["9"], list("0123"), "0123", False, id="stop-never-seen"),
        pytest.param("01234", ["345", "12"], ["", "", "0", ""], "0", True, id="earliest-wins"),
        pytest.param("2222", ["2"], [""], "", True, id="stop-at-once"),
    ],
)
def test_deltas_join_to_the_final_text(text, stop, deltas, final, stopped):
    tokenizer = CharTokenizer()
    stream = TextStream(tokenizer, stop)
    ids = tokenizer.encode(text)
    got = pushed(stream, ids[: len(deltas)])
    assert got == deltas
    assert stream.stopped is stopped
    assert stream.final_text() == final
    assert final.startswith("".join(got))


def test_a_character_split_over_tokens_is_sent_whole():
    ids = list("añ€b".encode())  # a, 2 bytes, 3 bytes, b
    stream = TextStream(BytePieces())
    assert pushed(stream, ids) == ["a", "", "ñ", "", "", "€", "b"]
    assert stream.final_text() == "añ€b"


def test_tokens_after_the_stop_add_nothing():
    tokenizer = CharTokenizer()
    stream = TextStream(tokenizer, ["1"])
    assert pushed(stream, tokenizer.encode("0123")) == ["0", "", "", ""]
    assert stream.final_text() == "0"
