"""Capture windows as plain data: their text, and the rows each keeps."""

import numpy as np
import pytest

from fake_session import llama_catalogue
from inspector.core.windows import (CaptureWindow, checked_windows, parse_window_option,
                                       windows_from_patterns)


@pytest.mark.parametrize("text", ["all", "generated", "last:1", "last:16", "every:4"])
def test_text_round_trips(text):
    assert str(CaptureWindow.parse(text)) == text
    assert CaptureWindow.parse(f" {text} ") == CaptureWindow.parse(text)


@pytest.mark.parametrize("text, says", [("", "unknown"), ("some", "unknown"), ("first:3", "unknown"),
                                         ("last", "needs a number"), ("last:", "needs a number"), ("last:0", "from 1"),
                                         ("every:-2", "needs a number"), ("every:x", "needs a number"),
                                         ("every:1.5", "needs a number"), ("every:99999999999999999999", "from 1"),
                                         ("generated:2", "takes no number"), ("all:1", "takes no number")])
def test_bad_text_is_refused_saying_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=says):
        CaptureWindow.parse(text)


def test_text_is_read_whatever_its_case():
    assert CaptureWindow.parse("ALL") == CaptureWindow.parse("all")
    assert CaptureWindow.parse(" Last:4") == CaptureWindow("last", 4)


def test_each_kind_keeps_the_positions_it_promises():
    positions = np.arange(10)  # a prompt of 6 tokens, then 4 generated ones' rows
    kept = {text: positions[CaptureWindow.parse(text).keeps(positions, 6)].tolist()
            for text in ("all", "generated", "last:3", "last:20", "every:3")}
    assert kept == {"all": list(range(10)), "generated": [5, 6, 7, 8, 9], "last:3": [3, 4, 5, 6, 7, 8, 9],
                    "last:20": list(range(10)), "every:3": [0, 3, 6, 9]}
    chunk = np.arange(4, 8)  # a later forward's rows only
    assert chunk[CaptureWindow.parse("generated").keeps(chunk, 6)].tolist() == [5, 6, 7]


def test_hooks_are_named_by_installed_name_or_alias_and_all_is_left_out():
    installed = {p.name: p for p in llama_catalogue() if p.alias.endswith("hook_resid_post")}
    first = next(iter(installed.values()))
    assert checked_windows({first.alias: "every:2", first.name: CaptureWindow("every", 2)}, installed) == {
        first.name: CaptureWindow("every", 2)}
    assert checked_windows({first.alias: "all"}, installed) == {}
    with pytest.raises(ValueError, match="not an installed hook"):
        checked_windows({"blocks.9.hook_resid_post": "generated"}, installed)
    with pytest.raises(ValueError, match="two windows"):
        checked_windows({first.alias: "every:2", first.name: "generated"}, installed)


def test_patterns_apply_in_order_and_must_match():
    installed = {p.name: p for p in llama_catalogue() if p.alias.endswith("hook_resid_post")}
    windows = windows_from_patterns([("*", "generated"), ("blocks.1.*", "last:2")], installed)
    assert sorted(map(str, windows.values())) == ["generated", "last:2"]
    assert windows_from_patterns([("*", "generated"), ("*", "all")], installed) == {}
    with pytest.raises(ValueError, match="matches no captured hook"):
        windows_from_patterns([("blocks.7.*", "generated")], installed)
    assert parse_window_option("generated") == ("*", "generated")
    assert parse_window_option("blocks.*.hook_resid_post=every:4") == ("blocks.*.hook_resid_post", "every:4")
    with pytest.raises(ValueError, match="before '='"):
        parse_window_option("=generated")
    for bad in ("blocks.*=bogus", "last", "every:0"):  # the syntax said once, whichever part is wrong
        with pytest.raises(ValueError) as refused:
            parse_window_option(bad)
        assert str(refused.value).count("last:N or every:K") == 1


@pytest.mark.parametrize("text", ["all", "generated", "last:1", "last:4", "last:20", "every:1", "every:3"])
def test_keeps_all_from_is_where_a_window_starts_keeping_every_row(text):
    window, prompt_len, positions = CaptureWindow.parse(text), 9, np.arange(40)
    start = window.keeps_all_from(prompt_len)
    kept = window.keeps(positions, prompt_len)
    assert kept[positions >= start].all()
    if 0 < start < len(positions):
        assert not kept[int(start) - 1]
    if np.isinf(start):
        assert not kept.all()
