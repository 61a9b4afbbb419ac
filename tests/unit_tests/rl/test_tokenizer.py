"""``CharTokenizer``: id layout, round trip, EOS/PAD handling and errors that name the culprit."""

from __future__ import annotations

import pytest

from megatron.rl.tokenizer import DEFAULT_ALPHABET, CharTokenizer


def test_id_layout_pad_eos_then_alphabet():
    tok = CharTokenizer("ab")
    assert (tok.pad_id, tok.eos_id) == (0, 1)
    assert tok.encode("ab") == [2, 3]
    assert tok.vocab_size == 4
    assert CharTokenizer().vocab_size == len(DEFAULT_ALPHABET) + 2


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("4071=", id="copy-prompt"),
        pytest.param("47+18=65", id="addition"),
        pytest.param(DEFAULT_ALPHABET, id="whole-alphabet"),
        pytest.param("  ??..", id="repeats"),
    ],
)
def test_round_trip(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(2 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize(
    "ids, text",
    [
        pytest.param([2, 3, 1, 4, 5], "01", id="stops-at-eos"),
        pytest.param([1, 2, 3], "", id="eos-first"),
        pytest.param([0, 2, 0, 3, 0], "01", id="skips-pad"),
        pytest.param([2, 1, 99, -5], "0", id="ids-after-eos-ignored"),
        pytest.param([], "", id="empty"),
    ],
)
def test_decode_eos_and_pad(ids, text):
    assert CharTokenizer().decode(ids) == text


@pytest.mark.parametrize("char", ["a", "\n", "é", "/"])
def test_unknown_character_raises_value_error_naming_it(char):
    tok = CharTokenizer()
    with pytest.raises(ValueError) as info:
        tok.encode(f"12{char}3")
    assert repr(char) in str(info.value)


@pytest.mark.parametrize("bad", [-1, 21, 1000])
def test_out_of_range_id_raises(bad):
    tok = CharTokenizer()
    assert tok.vocab_size == 21
    with pytest.raises(ValueError, match=str(bad)):
        tok.decode([2, bad])


def test_vocab_size_boundary_is_exclusive():
    tok = CharTokenizer("xyz")
    assert tok.decode([tok.vocab_size - 1]) == "z"
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])


def test_duplicate_alphabet_rejected():
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("0123405")
