"""RequestState: committing tokens, stop conditions, streamed text and draft budgets.

Tokens here are bytes: ids 0..255 detokenize as UTF-8, so a multi-byte character split across
tokens shows up as a trailing U+FFFD, exactly as with a byte-level BPE."""

import pytest

from specserve.decoding.sampling import SamplingParams, draft_seed
from specserve.decoding.sequence import RequestState, SpecStats

EOS = 256


def detokenize(token_ids: list[int]) -> str:
    return bytes(token_ids).decode("utf-8", errors="replace")


def tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def make_state(max_tokens: int = 32, stop: list[str] | None = None, prompt: str = "hi",
               max_context: int = 1024) -> RequestState:
    return RequestState(request_id="r", prompt_ids=tokens(prompt),
                        params=SamplingParams(max_tokens=max_tokens, stop=stop or []),
                        eos_token_id=EOS, max_context=max_context, detokenize=detokenize)


def test_commit_stops_at_eos_without_appending_it():
    state = make_state()
    committed = state.commit(tokens("ab") + [EOS] + tokens("cd"))
    assert committed == tokens("ab")
    assert state.output_ids == tokens("ab")
    assert state.finish_reason == "stop"
    assert state.finished


def test_commit_stops_at_max_tokens_with_reason_length():
    state = make_state(max_tokens=3)
    assert state.commit(tokens("ab")) == tokens("ab")
    assert not state.finished
    assert state.commit(tokens("cde")) == tokens("c")
    assert state.output_ids == tokens("abc")
    assert state.finish_reason == "length"


def test_commit_stops_at_max_context_with_reason_length():
    state = make_state(prompt="0123456", max_context=10)
    assert state.commit(tokens("abcdef")) == tokens("abc")
    assert len(state.history) == 10
    assert state.finish_reason == "length"


def test_commit_after_finishing_appends_nothing():
    state = make_state(max_tokens=1)
    state.commit(tokens("a"))
    assert state.commit(tokens("b")) == []
    assert state.output_ids == tokens("a")


def test_commit_stops_when_a_stop_string_appears():
    state = make_state(stop=["\n\n", "END"])
    committed = state.commit(tokens("x = 1ENDy = 2"))
    assert committed == tokens("x = 1END")        # the token completing the stop string is kept
    assert state.finish_reason == "stop"
    assert state.output_text == "x = 1"           # ...but the text is cut before the stop string


def test_output_text_cuts_at_the_earliest_stop_string():
    state = make_state(stop=["END", "\n\n"])
    state.commit(tokens("a\n"))
    state.commit(tokens("\nbEND"))
    assert state.output_text == "a"


def test_text_delta_holds_back_a_partial_stop_string():
    state = make_state(stop=["END"])
    state.commit(tokens("abcE"))
    assert state.take_text_delta() == "abc"
    state.commit(tokens("N"))
    assert state.take_text_delta() == ""
    state.commit(tokens("D"))
    assert state.finished
    assert state.take_text_delta() == ""
    assert state.output_text == "abc"


def test_text_delta_releases_a_held_tail_that_did_not_become_a_stop_string():
    state = make_state(stop=["END"])
    state.commit(tokens("abEN"))
    assert state.take_text_delta() == "ab"
    state.commit(tokens("x"))
    assert state.take_text_delta() == "ENx"


def test_text_delta_holds_back_an_incomplete_character():
    state = make_state()
    euro = tokens("€")                             # three UTF-8 bytes
    state.commit(tokens("a") + euro[:2])
    assert state.take_text_delta() == "a"
    state.commit(euro[2:])
    assert state.take_text_delta() == "€"


def test_text_delta_flushes_the_held_tail_when_finished():
    state = make_state(max_tokens=3, stop=["END"])
    state.commit(tokens("abE"))
    assert state.finish_reason == "length"
    assert state.take_text_delta() == "abE"


def test_text_deltas_concatenate_to_the_output_text():
    state = make_state(stop=["STOP"], max_tokens=64)
    deltas = []
    for chunk in ["Hel", "lo S", "T", "art ", "é", "ST", "OP!"]:
        state.commit(tokens(chunk))
        deltas.append(state.take_text_delta())
    assert state.finish_reason == "stop"
    assert "".join(deltas) == state.output_text == "Hello STart é"


def test_draft_budget_is_capped_by_depth_max_tokens_and_context():
    assert make_state(max_tokens=100).draft_budget(4) == 4
    # Accepted drafts plus the bonus token must fit in max_tokens...
    state = make_state(max_tokens=5)
    state.commit(tokens("ab"))
    assert state.draft_budget(8) == 2
    # ...and in the context.
    state = make_state(prompt="0123456", max_context=10)
    assert state.draft_budget(8) == 2
    # Never negative.
    state = make_state(max_tokens=2)
    state.commit(tokens("a"))
    assert state.draft_budget(8) == 0


def test_prompt_must_leave_room_for_one_token():
    with pytest.raises(ValueError, match="no room"):
        make_state(prompt="0123456789", max_context=10)
    with pytest.raises(ValueError, match="at least one token"):
        make_state(prompt="")


def test_stop_strings_need_a_detokenizer():
    with pytest.raises(ValueError, match="detokenize"):
        RequestState(request_id="r", prompt_ids=[1], params=SamplingParams(stop=["x"]),
                     eos_token_id=None, max_context=16, detokenize=None)


def test_seeded_request_gets_reproducible_distinct_generators():
    params = SamplingParams(seed=11)
    first = RequestState(request_id="a", prompt_ids=[1], params=params, eos_token_id=None, max_context=16)
    second = RequestState(request_id="b", prompt_ids=[1], params=params, eos_token_id=None, max_context=16)
    assert first.generator.initial_seed() == second.generator.initial_seed() == 11
    assert first.draft_generator.initial_seed() == draft_seed(11) != 11


def test_spec_stats_rates():
    assert SpecStats().acceptance_rate == 0.0
    assert SpecStats().mean_tokens_per_pass == 0.0
    stats = SpecStats(rounds=2, num_drafted=8, num_accepted=6, num_emitted=9, target_passes=3)
    assert stats.acceptance_rate == 0.75
    assert stats.mean_tokens_per_pass == 3.0
    assert stats.to_dict() == {"rounds": 2, "num_drafted": 8, "num_accepted": 6, "num_emitted": 9,
                               "target_passes": 3, "acceptance_rate": 0.75, "mean_tokens_per_pass": 3.0,
                               "mean_accepted_per_round": 3.0, "pipelined_rounds": 0, "speculation_cache_misses": 0,
                               "num_discarded_ahead": 0, "draft_failures": 0, "target_failovers": 0,
                               "draft_version": 0}


def test_ignore_eos_appends_eos_and_keeps_going():
    state = RequestState(request_id="r", prompt_ids=tokens("hi"), params=SamplingParams(max_tokens=4, ignore_eos=True),
                         eos_token_id=EOS, max_context=1024)
    assert state.commit(tokens("a") + [EOS] + tokens("bcd")) == tokens("a") + [EOS] + tokens("bc")
    assert state.finish_reason == "length"


def test_stop_strings_are_looked_for_only_past_min_tokens():
    # As vLLM: a stop string inside the first min_tokens tokens does not end the request.
    state = RequestState(request_id="r", prompt_ids=tokens("hi"),
                         params=SamplingParams(max_tokens=20, min_tokens=3, stop=["x"]),
                         eos_token_id=EOS, max_context=1024, detokenize=detokenize)
    assert state.commit(tokens("axbcxd")) == tokens("axbcx")
    assert state.finish_reason == "stop" and state.output_text == "axbc"


def test_next_output_index_is_the_position_the_next_verify_rows_start_at():
    state = make_state()
    assert state.next_output_index == 0
    state.commit(tokens("abc"))
    assert state.next_output_index == 3


def test_every_id_of_an_eos_set_ends_a_request():
    for eos in (EOS, 257):
        state = RequestState(request_id="r", prompt_ids=tokens("hi"), params=SamplingParams(max_tokens=9),
                             eos_token_id=frozenset({EOS, 257}), max_context=64, detokenize=detokenize)
        assert state.commit(tokens("a") + [eos] + tokens("b")) == tokens("a") and state.finish_reason == "stop"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids_end_a_request_even_with_ignore_eos(include):
    params = SamplingParams(max_tokens=9, stop_token_ids=[ord("x")], ignore_eos=True,
                            include_stop_str_in_output=include)
    state = RequestState(request_id="r", prompt_ids=tokens("hi"), params=params, eos_token_id=EOS,
                         max_context=64, detokenize=detokenize)
    state.commit(tokens("a") + [EOS] + tokens("bxc"))
    assert state.finish_reason == "stop"
    assert state.output_ids == tokens("a") + [EOS] + tokens("bx" if include else "b")


@pytest.mark.parametrize("include, text", [(False, "ab"), (True, "abSTOP")])
def test_include_stop_str_in_output_keeps_the_stop_string(include, text):
    params = SamplingParams(max_tokens=20, stop=["STOP"], include_stop_str_in_output=include)
    state = RequestState(request_id="r", prompt_ids=tokens("hi"), params=params, eos_token_id=EOS,
                         max_context=64, detokenize=detokenize)
    state.commit(tokens("abSTOPcd"))
    assert state.finish_reason == "stop" and state.output_text == text
