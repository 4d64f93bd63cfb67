"""Stop strings across token boundaries: streaming them equals cutting the whole text at the first stop."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import npllm
from npllm.errors import GenerationError
from npllm.stop import StopStrings, cut_at_stop

alphabet = st.sampled_from("ab .\n")


@given(st.lists(st.text(alphabet, max_size=4), max_size=12), st.lists(st.text(alphabet, min_size=1, max_size=4),
                                                                       max_size=3))
def test_streamed_stops_equal_cutting_the_whole_text(pieces, stops):
    f = StopStrings(stops)
    out = ""
    for piece in pieces:
        released = f.feed(piece)
        assert not any(s in out + released for s in stops)
        out += released
        if f.stopped:
            break
    out += f.flush()
    assert out == cut_at_stop("".join(pieces), stops)


def test_held_text_is_released_when_the_stop_does_not_come():
    f = StopStrings(["upon a"])
    assert f.feed("Once up") == "Once "
    assert f.feed("on the") == "upon the"
    assert f.flush() == ""


def test_empty_stop_string_is_an_error():
    with pytest.raises(GenerationError, match="empty"):
        StopStrings([""])


def test_generate_stops_before_a_string_spanning_tokens(stories260k):
    llm = npllm.load(stories260k)
    full = llm.generate("Lily and Ben", max_new_tokens=40, temperature=0)
    stop = "y liked to"  # spans several tokens of " They liked to play"
    assert stop in full
    assert llm.generate("Lily and Ben", max_new_tokens=40, temperature=0, stop=[stop]) == full[: full.index(stop)]
    assert llm.generate(["Lily and Ben"], max_new_tokens=40, temperature=0, stop=[stop]) == [full[: full.index(stop)]]
