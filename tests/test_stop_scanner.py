"""The worker's stop scanner on decoded text as it grows (no model: the texts stand for what the tokenizer
decodes after each token)."""

import itertools

from dsflash.server.worker import StopScanner


def scan(stops: list[str], pieces: list[str]) -> tuple[list[str], str | None, str]:
    """Feed the text after each piece: (what each feed gave out, the stop string matched, what the flush at
    the end gives out)."""
    scanner, text, out = StopScanner(stops), "", []
    for piece in pieces:
        text += piece
        sent, stop = scanner.feed(text)
        out.append(sent)
        if stop is not None:
            return out, stop, scanner.flush()
    return out, None, scanner.flush()


def test_a_stop_string_split_across_pieces():
    assert scan(["STOP"], ["Hello S", "TO", "P and more"]) == (["Hello ", "", ""], "STOP", "")
    # the text before the stop string that came in the same piece is given out with the match
    assert scan(["</end>"], ["one </", "e", "nd> two"]) == (["one ", "", ""], "</end>", "")
    assert scan(["</end>"], ["one", " two</e", "nd>"]) == (["one", " two", ""], "</end>", "")


def test_a_held_back_prefix_is_released():
    # "ab" could start "abc" until the "d" shows it does not
    assert scan(["abc"], ["xa", "b", "d", "e"]) == (["x", "", "abd", "e"], None, "")
    # held back when the generation ends: the flush gives it out
    assert scan(["abc"], ["xa", "b"]) == (["x", ""], None, "ab")


def test_several_stop_strings():
    # the earliest match wins, whichever is listed first
    assert scan(["END", "\n\n"], ["one\n", "\ntwo END"]) == (["one", ""], "\n\n", "")
    assert scan(["\n\n", "END"], ["one EN", "D\n\n"]) == (["one ", ""], "END", "")
    # at one position, the first one listed
    assert scan(["ab", "abc"], ["x", "abc"]) == (["x", ""], "ab", "")
    assert scan(["abc", "ab"], ["x", "abc"]) == (["x", ""], "abc", "")
    # the hold back is of the longest stop string's prefixes: "xy" waits for "xyz", "q" for "qr"
    assert scan(["qr", "xyz"], ["1xy", "w2q", "s"]) == (["1", "xyw2", "qs"], None, "")


def test_a_stop_at_the_very_start():
    assert scan(["<stop>"], ["<stop>and after"]) == ([""], "<stop>", "")
    assert scan(["<stop>"], ["<", "st", "op>"]) == (["", "", ""], "<stop>", "")


def test_no_stop():
    # without stop strings everything is given out at once
    assert scan([], ["a", "bc", "def"]) == (["a", "bc", "def"], None, "")
    # with stop strings that never match, only their possible starts wait
    assert scan(["STOP"], ["all", " S", "o well"]) == (["all", " ", "So well"], None, "")


def test_a_partial_character_waits_for_its_bytes():
    # the decoded text ends in U+FFFD while a character's bytes are incomplete; the next text completes it
    scanner = StopScanner([])
    assert scanner.feed("ab\ufffd") == ("ab", None)
    assert scanner.feed("ab\u00e9") == ("\u00e9", None)
    assert scanner.feed("ab\u00e9\ufffd\ufffd") == ("", None)
    assert scanner.flush() == "\ufffd\ufffd"  # still incomplete at the end: given out as decoded


def test_every_split_gives_the_text_before_the_stop():
    text, stops = "say <<a< then <<b> and <<c>>", ["<<b>", "<<c>>"]
    for cuts in itertools.combinations(range(1, len(text)), 3):
        bounds = (0, *cuts, len(text))
        out, stop, rest = scan(stops, [text[a:b] for a, b in itertools.pairwise(bounds)])
        assert (stop, "".join(out) + rest) == ("<<b>", "say <<a< then "), cuts
