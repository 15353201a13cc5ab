"""The Dashboard without Qt (``viewer.dashboard``): the units listed are those active somewhere, strongest
first, found by id or label text; a unit's examples are its kept windows as text, the activating token
apart and made visible; its histogram is the file's counts; the header says what was scanned and an
unfinished scan says so; a file that is not a scan, or whose arrays do not fit, is refused with the reason."""

import h5py
import numpy as np
import pytest

from inspector.experiments.scan import BEFORE
from inspector.io.scan import read_scan, write_scan
from inspector.viewer.dashboard import open_dashboard, running_text
from inspector.viewer.feature_labels import scan_labels
from scan_files import DORMANT, VOCABULARY, write_synthetic_scan

SAE = {"path": "/saes/python_sae", "architecture": "topk", "d_in": 128, "d_sae": 64, "k": 16}


@pytest.fixture
def scan_file(tmp_path):
    path = tmp_path / "scan.h5"
    write_synthetic_scan(path, SAE)
    return path


def test_the_units_are_the_active_ones_strongest_first(scan_file):
    d = open_dashboard(scan_file)
    state, _, _ = read_scan(scan_file)
    peaks = state.top_activations[:, 0]
    assert sorted(d.units.tolist()) == list(range(DORMANT))  # the dormant ones are left out
    assert np.all(np.diff(peaks[d.units]) <= 0)
    assert d.names == scan_labels(state, VOCABULARY) and d.prefix == "f"
    unit = int(d.units[0])
    assert d.label(unit) == f"f{unit} {d.names[unit]}" and d.peak(unit) == peaks[unit]


def test_the_filter_takes_an_id_or_label_text(scan_file):
    d = open_dashboard(scan_file)
    assert d.search("") == d.search("  ") == d.units.tolist()
    assert d.search("12")[0] == 12 and d.search("f12")[0] == 12 and d.search("F12")[0] == 12
    assert all("12" in d.label(u) for u in d.search("12"))
    word = d.names[5].split(" · ")[0]
    found = d.search(word.upper())
    assert 5 in found and all(word.lower() in d.label(u).lower() for u in found)
    assert found == [u for u in d.units.tolist() if u in found]  # strongest first
    assert d.search(str(DORMANT + 1)) == [] and d.search("no such label") == []


def test_a_units_examples_are_its_windows_as_text(scan_file):
    d = open_dashboard(scan_file)
    state, _, vocabulary = read_scan(scan_file)
    unit = int(d.units[3])
    examples = d.examples(unit)
    assert len(examples) == state.top
    for i, e in enumerate(examples):
        window = state.top_windows[unit, i]
        text = [vocabulary[t] if t >= 0 else "" for t in window.tolist()]
        assert (e.activation, e.document, e.position) == (state.top_activations[unit, i], state.top_documents[unit, i],
                                                          state.top_positions[unit, i])
        assert e.before == running_text("".join(text[:BEFORE])) and e.after == running_text("".join(text[BEFORE + 1:]))
        assert e.token == {"\n": "↵", "    ": "␣␣␣␣"}.get(text[BEFORE], text[BEFORE])
    assert running_text("a\nb\tc ") == "a↵b⇥c "
    assert d.examples(DORMANT) == [] and "not active anywhere in the 30 documents" in d.describe_unit(DORMANT)


def test_a_units_histogram_is_the_files_counts(scan_file):
    d = open_dashboard(scan_file)
    state, _, _ = read_scan(scan_file)
    unit = int(d.units[0])
    h = d.histogram(unit)
    np.testing.assert_array_equal(h.counts, state.histogram[unit, 1:-1])
    np.testing.assert_array_equal(h.edges, state.edges)
    assert (h.below, h.above) == (state.histogram[unit, 0], state.histogram[unit, -1])
    total = int(state.histogram[unit].sum())
    assert h.overflow_text().endswith(f"(outside the bars); {total} activations in all")
    assert d.describe_unit(unit) == (f"{d.label(unit)}: strongest {d.peak(unit):.3f}; among the token's strongest "
                                     f"features at {total} tokens")


def test_the_header_says_what_was_scanned_and_whether_it_is_finished(tmp_path, scan_file):
    d = open_dashboard(scan_file)
    assert d.header() == ("Scan scan.h5 · model demo · hook blocks.1.hook_resid_post · SAE python_sae (64 features, "
                          "the 16 strongest per token) · 30 of 30 documents · 1440 tokens · 40 of 64 units active, "
                          "top 6 kept each")
    assert d.unfinished() == "" and d.sae_path == "/saes/python_sae"
    write_synthetic_scan(tmp_path / "partial.h5", None, done=12)
    partial = open_dashboard(tmp_path / "partial.h5")
    assert "64 neurons · 12 of 30 documents · 576 tokens" in partial.header()
    assert partial.unfinished().startswith("Unfinished: 12 of 30 documents scanned so far")
    assert partial.prefix == "n" and partial.label(3).startswith("n3 ") and partial.sae_path is None


def test_a_file_that_is_not_a_scan_is_refused_with_the_reason(tmp_path, scan_file):
    text = tmp_path / "notes.h5"
    text.write_text("not HDF5")
    with pytest.raises(OSError, match="is not a scan file this reads"):
        open_dashboard(text)
    with h5py.File(tmp_path / "capture.h5", "w") as f:
        f.attrs["format"] = "activation-inspector"
    with pytest.raises(OSError, match="format 'activation-inspector'"):
        open_dashboard(tmp_path / "capture.h5")
    state, settings, vocabulary = read_scan(scan_file)
    state.top_windows = state.top_windows[:, :, :5]
    write_scan(state, settings, vocabulary, tmp_path / "odd.h5")
    with pytest.raises(ValueError, match=r"top_windows is \[64, 6, 5\], not \[64, 6, 12\]"):
        open_dashboard(tmp_path / "odd.h5")
