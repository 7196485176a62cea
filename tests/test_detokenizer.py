"""Incremental detokenization (decoding/detokenizer.py, RequestState's text): the same text, stop
handling and held-back tails as re-decoding the whole output every time, at a cost per token that
does not grow with the output."""

import random

import pytest
from transformers import AutoTokenizer

from specserve.decoding.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState
from tests.tiny_pair import TOKENIZER_DIR

EOS = 256


def byte_decode(token_ids: list[int]) -> str:
    return bytes(t for t in token_ids if t != EOS).decode("utf-8", errors="replace")


class QuadraticReference:
    """The previous RequestState text logic, verbatim in spirit: re-decode everything, every time."""

    def __init__(self, stop: list[str]) -> None:
        self.stop, self.ids, self.sent, self.finished = stop, [], 0, False

    def find_stop(self, text: str) -> int:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def commit(self, token: int) -> bool:
        self.ids.append(token)
        return bool(self.stop) and self.find_stop(byte_decode(self.ids)) >= 0

    def text(self) -> str:
        text = byte_decode(self.ids)
        cut = self.find_stop(text) if self.stop else -1
        return text if cut < 0 else text[:cut]

    def delta(self) -> str:
        text = self.text()
        end = len(text)
        if not self.finished:
            end = len(text.rstrip(REPLACEMENT_CHAR))
            sizes = [next((n for n in range(min(len(s) - 1, end), 0, -1) if text.endswith(s[:n], 0, end)), 0)
                     for s in self.stop]
            end -= max(sizes, default=0)
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta


ALPHABET = ["a", "b", "E", "N", "D", " ", "\n", "é", "€", "日", "🎉"]
STOPS = [[], ["END"], ["\n\n", "é€"], ["D"], ["🎉a"], ["aa", "ab", "NE"]]


@pytest.mark.parametrize("seed", range(60))
def test_incremental_text_equals_whole_output_redecoding(seed):
    """Random byte streams (multi-byte characters split across tokens, a stray invalid byte),
    random commit batches and random chunking: every delta, the stop position, the finish reason
    and the final text equal those of the quadratic reference."""
    rng = random.Random(seed)
    data = b"".join(rng.choice(ALPHABET).encode() for _ in range(rng.randint(1, 40)))
    if rng.random() < 0.2:
        data += bytes([0xFF]) + data[:3]
    stop = STOPS[seed % len(STOPS)]
    max_tokens = rng.randint(1, len(data) + 2)
    state = RequestState(request_id="r", prompt_ids=[1], params=SamplingParams(max_tokens=max_tokens, stop=stop),
                         eos_token_id=EOS, max_context=10_000, detokenize=byte_decode)
    reference = QuadraticReference(stop)
    tokens = list(data)
    position = 0
    while position < len(tokens) and not state.finished:
        batch = tokens[position:position + rng.randint(1, 5)]
        position += len(batch)
        committed = state.commit(batch)
        for token in committed:
            if reference.commit(token):
                reference.finished = True
            elif len(reference.ids) >= max_tokens:
                reference.finished = True
        assert reference.finished == state.finished
        if rng.random() < 0.6:
            assert state.take_text_delta() == reference.delta()
    assert state.take_text_delta() == reference.delta()
    # While running, output_text holds complete characters only (the reference shows U+FFFD).
    assert state.output_text == (reference.text() if state.finished else reference.text().rstrip(REPLACEMENT_CHAR))


def test_a_character_split_across_three_tokens_comes_out_whole():
    detokenizer = IncrementalDetokenizer(byte_decode)
    ids = list("a€b".encode())                  # a, 3 bytes of €, b
    pieces = [detokenizer.step(ids[:end]) for end in range(1, len(ids) + 1)]
    assert pieces == ["a", "", "", "€", "b"]


def test_flush_hands_out_an_incomplete_trailing_character_as_a_replacement_char():
    detokenizer = IncrementalDetokenizer(byte_decode)
    ids = list("a€".encode())[:-1]
    assert detokenizer.step(ids) == "a"
    assert detokenizer.flush(ids) == REPLACEMENT_CHAR


def test_stop_string_completed_by_a_token_that_also_begins_a_character_stops_at_that_token():
    # Tokens of several bytes: "EN", then "D" + the first byte of "€", then the rest of "€".
    vocab = {0: b"EN", 1: b"D" + "€".encode()[:1], 2: "€".encode()[1:], 3: b"x"}

    def decode(ids):
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    state = RequestState(request_id="r", prompt_ids=[3], params=SamplingParams(max_tokens=10, stop=["END"]),
                         eos_token_id=None, max_context=100, detokenize=decode)
    assert state.commit([3, 0, 1, 2]) == [3, 0, 1]
    assert state.finish_reason == "stop"
    assert state.take_text_delta() == "x" and state.output_text == "x"


def test_the_real_tokenizer_decodes_incrementally_to_its_whole_output_decoding():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    text = "def f(x):\n    return 'héllo wörld' + \"日本語 🎉\"  # ≥ ≤\n" * 3
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    ids = ids + [rng.randrange(len(tokenizer)) for _ in range(200)]   # arbitrary byte soup too
    ids[10:10] = [tokenizer.eos_token_id] * 12                        # skipped special tokens

    def decode(token_ids):
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    detokenizer = IncrementalDetokenizer(decode)
    pieces = [detokenizer.step(ids[:end]) for end in range(1, len(ids) + 1)]
    assert "".join(pieces) + detokenizer.flush(ids) == decode(ids)


def test_decoding_work_per_token_does_not_grow_with_the_output():
    """Count the token ids decoded: the cost of token n must not depend on n (it did: n ids)."""
    decoded_ids = []

    def counting_decode(token_ids):
        decoded_ids.append(len(token_ids))
        return byte_decode(token_ids)

    state = RequestState(request_id="r", prompt_ids=[1], params=SamplingParams(max_tokens=4000, stop=["STOP"]),
                         eos_token_id=EOS, max_context=10_000, detokenize=counting_decode)
    text = ("héllo wörld, 日本 🎉 " * 200).encode()[:3000]
    for start in range(0, len(text), 3):
        state.commit(list(text[start:start + 3]))
        state.take_text_delta()
    assert len(state.output_ids) == 3000 and not state.finished
    # Windows stay a few tokens wide (a character is at most 4 bytes here), calls a few per token.
    assert max(decoded_ids) <= 8
    assert len(decoded_ids) <= 3 * len(state.output_ids)
