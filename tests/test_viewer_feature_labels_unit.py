"""Feature labels (``viewer.feature_labels``): a feature's top tokens are the distinct tokens it fired on in
its strongest examples, most frequent first (ties: the stronger first), up to three, made visible; a
labels.json beside the SAE names features over them; a bad labels.json is a ValueError naming the file;
a scan the user opened labels its SAE's features, before the scan.h5 in the SAE's directory; and the
book notices an edited file."""

import json
import os

import numpy as np
import pytest

from inspector.experiments.scan import ScanState
from inspector.io.scan import write_scan
from inspector.viewer.feature_labels import (NO_LABELS, FeatureLabels, LabelBook, read_labels_file, scan_labels,
                                             top_tokens)

VOCABULARY = {10: " def", 11: "\n", 12: " ", 13: "class", 14: " def "}
DOCUMENT = np.array([10, 11, 12, 10, 13, 11, 10, 14])


def hand_made_scan() -> ScanState:
    """Unit 0 fires on 10, 11, 10, 11 (strongest first): a tie of two each; unit 1 on 10, 10, 11, 10;
    unit 2 on 12, 11, 11, 13 (the strongest token is the rarer one); unit 3 on four distinct tokens;
    unit 4 never."""
    state = ScanState(5, 4)
    hits = {0: [(0, 5.0), (1, 4.0), (3, 3.0), (5, 2.0)], 1: [(1, 1.0), (0, 2.0), (3, 3.0), (6, 0.5)],
            2: [(2, 9.0), (1, 2.0), (5, 1.0), (4, 0.5)], 3: [(0, 4.0), (1, 3.0), (2, 2.0), (4, 1.0)]}
    units = [u for u, pairs in hits.items() for _ in pairs]
    positions = [p for pairs in hits.values() for p, _ in pairs]
    activations = [a for pairs in hits.values() for _, a in pairs]
    state.add(np.array(units), np.array(activations), 0, np.array(positions), DOCUMENT)
    state.flush()
    return state


def test_a_features_top_tokens_are_its_most_frequent_activating_tokens():
    state = hand_made_scan()
    tops = top_tokens(state)
    assert tops[0].tolist() == [10, 11, -1, -1]  # two each: the one of the stronger example first
    assert tops[1].tolist() == [10, 11, -1, -1]
    assert tops[2].tolist() == [11, 12, 13, -1]  # twice beats the strongest once
    assert tops[4].tolist() == [-1, -1, -1, -1]
    assert scan_labels(state, VOCABULARY) == {0: "def · ↵", 1: "def · ↵", 2: "↵ · ␣ · class",
                                              3: "def · ↵ · ␣"}  # at most three


def test_tokens_that_read_the_same_make_one_piece_and_unknown_ids_say_so():
    state = ScanState(1, 3)
    state.add(np.zeros(3, int), np.array([3.0, 2.0, 1.0]), 0, np.array([0, 7, 4]), DOCUMENT)
    state.flush()
    assert scan_labels(state, VOCABULARY) == {0: "def · class"}  # " def" and " def " are one piece
    assert scan_labels(state, {}) == {0: "<10> · <14> · <13>"}


def test_labels_json_names_features(tmp_path):
    path = tmp_path / "labels.json"
    path.write_text(json.dumps({"3": "Python keywords ", "17": "closing brackets", "5": "  "}))
    assert read_labels_file(path) == {3: "Python keywords", 17: "closing brackets"}  # blank: no label


@pytest.mark.parametrize("text, reason", [
    ("{not json", "not readable JSON"),
    ("[1, 2]", "a JSON object of feature id -> label expected, not list"),
    ('{"f3": "x"}', "keys must be feature ids"),
    ('{"3": 4}', "keys must be feature ids (\"123\") and labels strings"),
])
def test_a_bad_labels_file_is_a_value_error_naming_it(tmp_path, text, reason):
    path = tmp_path / "labels.json"
    path.write_text(text)
    with pytest.raises(ValueError) as caught:
        read_labels_file(path)
    assert str(caught.value).startswith(f"{path}: ") and reason in str(caught.value)


def write_sae_scan(path, state=None):
    write_scan(state or hand_made_scan(), {"hook": "h", "sae": {"path": str(path.parent)}}, VOCABULARY, path)


def test_the_book_takes_labels_json_over_an_opened_scan_over_the_directorys_scan(tmp_path):
    sae = tmp_path / "sae"
    sae.mkdir()
    book = LabelBook()
    assert book.for_sae(sae) == NO_LABELS and NO_LABELS.describe() == ""
    write_sae_scan(sae / "scan.h5")
    labels = book.for_sae(sae)
    assert labels == FeatureLabels(scan_labels(hand_made_scan(), VOCABULARY), (str(sae / "scan.h5"),))
    assert labels.label(2) == "f2 ↵ · ␣ · class" and labels.label(4) == "f4" and labels.describe() == "labels: scan.h5"

    book.add_scan(sae, tmp_path / "bigger.h5", {2: "from the opened scan", 4: "dormant no more"})
    assert book.for_sae(sae).names == {2: "from the opened scan", 4: "dormant no more"}
    (sae / "labels.json").write_text(json.dumps({"2": "hand-written"}))
    labels = book.for_sae(sae)
    assert labels.names == {2: "hand-written", 4: "dormant no more"}  # per feature: labels.json first
    assert labels.describe() == "labels: labels.json, bigger.h5"


def test_the_book_rereads_an_edited_file_and_reports_a_bad_one(tmp_path):
    sae = tmp_path / "sae"
    sae.mkdir()
    write_sae_scan(sae / "scan.h5")
    book = LabelBook()
    labels_file = sae / "labels.json"
    labels_file.write_text(json.dumps({"0": "first"}))
    assert book.for_sae(sae).names[0] == "first"
    labels_file.write_text(json.dumps({"0": "second, longer"}))
    os.utime(labels_file, ns=(1, 1))  # a stamp of its own even within the clock's resolution
    assert book.for_sae(sae).names[0] == "second, longer"
    labels_file.write_text("{oops")
    broken = book.for_sae(sae)
    assert broken.names == scan_labels(hand_made_scan(), VOCABULARY)  # the scan's still label the features
    assert broken.problem.startswith(f"{labels_file}: not readable JSON") and broken.problem in broken.describe()


def test_a_scan_of_neurons_in_an_sae_directory_labels_nothing_and_says_why(tmp_path):
    sae = tmp_path / "sae"
    sae.mkdir()
    write_scan(hand_made_scan(), {"hook": "h", "sae": None}, VOCABULARY, sae / "scan.h5")
    labels = LabelBook().for_sae(sae)
    assert labels.names == {} and "is a scan of a hook's neurons" in labels.problem
