"""Corpus scans (inspector/experiments/scan.py, inspector/io/scan.py, ``inspector scan``): the kept top
contexts and histograms equal a brute-force pass over every activation, on synthetic data and on the
shared test server's engine (an SAE's features and a hook's neurons); an interrupted scan resumes from
its file to the same result; the command saves, resumes and refuses other settings."""

import json
import subprocess
import sys

import numpy as np
import pytest

from sae_files import saelens_encode, write_sae
from inspector.core.protocol import Sampling
from inspector.core.sae import strongest
from inspector.client import connect
from inspector.experiments.scan import AFTER, BEFORE, ScanSpec, ScanState, scan, windows_at
from inspector.io.scan import read_scan, write_scan

HOOK = "model.layers.1.resid_post"
DOCUMENTS = [line for line in """def fibonacci(n):
import os
class Parser(object):
for i in range(10): print(i)
return self.value + other.value
while True: break
x = [a for a in b if a]
with open(path) as f:
raise ValueError("bad")
try: pass
except KeyError: pass
lambda x: x * 2
yield from items
assert len(items) == 3
global counter
def __init__(self, name):""".splitlines()]


def brute_force_top(units, activations, top):
    """{unit: sorted activations (strongest first), at most ``top``} over every activation."""
    found = {}
    for u, a in zip(units, activations):
        found.setdefault(int(u), []).append(float(a))
    return {u: sorted(a, reverse=True)[:top] for u, a in found.items()}


def test_the_kept_top_and_histograms_equal_a_brute_force_pass():
    rng = np.random.default_rng(0)
    state, seen = ScanState(50, 5), []
    for document in range(30):
        tokens = rng.integers(0, 1000, rng.integers(5, 40))
        m = 3 * len(tokens)
        units, acts = rng.integers(0, 50, m), rng.exponential(1.0, m).astype(np.float32)
        positions = rng.integers(0, len(tokens), m)
        state.add(units, acts, document, positions, tokens)
        seen.append((units, acts, np.full(m, document), positions, tokens))
        if document % 7 == 6:  # taken in a few documents at a time, as a scan's batches
            state.flush()
    state.flush()
    units, acts = np.concatenate([s[0] for s in seen]), np.concatenate([s[1] for s in seen])
    expected = brute_force_top(units, acts, 5)
    for u in range(50):
        kept = state.top_activations[u][np.isfinite(state.top_activations[u])]
        np.testing.assert_array_equal(kept, expected.get(u, []))
        for j in range(len(kept)):  # each kept entry's document, position and window are its own
            d, p = state.top_documents[u, j], state.top_positions[u, j]
            units_d, acts_d, _, pos_d, tokens_d = seen[d]
            assert ((units_d == u) & (acts_d == kept[j]) & (pos_d == p)).any()
            np.testing.assert_array_equal(state.top_windows[u, j], windows_at([tokens_d], [p], [0])[0])
    assert state.histogram.sum() == len(acts)
    np.testing.assert_array_equal(state.histogram.sum(axis=1), np.bincount(units, minlength=50))


def test_dense_rows_keep_each_neurons_strongest_rows():
    rng = np.random.default_rng(1)
    state, all_values = ScanState(8, 4), []
    for document in range(6):
        values = rng.normal(0, 1, (int(rng.integers(2, 12)), 8)).astype(np.float32)
        state.add_rows(values, document, np.arange(len(values)), np.arange(len(values)) + 100)
        all_values.append(values)
    state.flush()
    stacked = np.concatenate(all_values)
    np.testing.assert_array_equal(state.top_activations, -np.sort(-stacked, axis=0)[:4].T)
    assert state.histogram.sum() == stacked.size


def test_windows_stop_at_the_documents_ends():
    window = windows_at([np.array([1, 2]), np.array([5, 6, 7])], [0, 2, 1], [1, 1, 0])
    assert window.shape == (3, BEFORE + 1 + AFTER)
    assert window[0].tolist() == [-1] * BEFORE + [5, 6, 7, -1]
    assert window[1].tolist() == [-1] * (BEFORE - 2) + [5, 6, 7] + [-1] * AFTER
    assert window[2].tolist() == [-1] * (BEFORE - 1) + [1, 2] + [-1] * AFTER


@pytest.fixture(scope="module")
def scanned(compiled_server, tmp_path_factory):
    """On the shared server: the documents' rows and their reference features, and a scan of them that
    was stopped after 8 documents, saved, read back and resumed."""
    root = tmp_path_factory.mktemp("scan")
    sae_dir = write_sae(root / "res1", "topk", 128, 1024, "blocks.1.hook_resid_post", k=12, seed=4)
    with connect(compiled_server[0]) as session:
        sae = session.attach_sae(sae_dir, k=16)
        session.new_run()
        list(session.generate(DOCUMENTS, Sampling(max_tokens=1, logprobs=0)))
        rows = [session.run.requests[rid].hooks[HOOK] for rid in list(session.run.requests)]
        state = ScanState(1024, 6)
        spec = ScanSpec(HOOK, sae.name, top=6, batch_tokens=30)  # a few documents a batch
        batches = []
        scan(session, DOCUMENTS, spec, state, progress=lambda s, _: batches.append(s.documents_done),
             cancelled=lambda: state.documents_done >= 8,
             save=lambda s: write_scan(s, {"hook": HOOK}, {}, root / "scan.h5"))
        assert 8 <= state.documents_done < len(DOCUMENTS)  # stopped between batches (the one running is kept)
        assert len(batches) > 2 and batches[-1] == state.documents_done
        resumed, settings, _ = read_scan(root / "scan.h5")
        assert settings == {"hook": HOOK}
        scan(session, DOCUMENTS, spec, resumed)
        neurons = scan(session, DOCUMENTS, ScanSpec(HOOK, None, top=3), ScanState(128, 3))
        session.detach_sae(sae.name)
    return sae_dir, rows, resumed, neurons


def test_a_resumed_scan_of_an_saes_features_equals_a_brute_force_pass(scanned):
    sae_dir, rows, state, _ = scanned
    assert state.documents_done == len(DOCUMENTS) and state.tokens_done == sum(len(r) for r in rows)
    units, acts = [], []
    for r in rows:
        ids, values = strongest(saelens_encode(sae_dir, r.values), 16)
        units.append(ids[ids >= 0])
        acts.append(values[ids >= 0])
    expected = brute_force_top(np.concatenate(units), np.concatenate(acts), 6)
    assert len(expected) > 20
    for unit, top in expected.items():
        np.testing.assert_allclose(state.top_activations[unit][:len(top)], top, rtol=1e-5)
    assert state.histogram.sum() == sum(len(u) for u in units)


def test_a_scan_of_neurons_keeps_each_neurons_strongest_rows(scanned):
    _, rows, _, state = scanned
    stacked = np.concatenate([r.values for r in rows])
    np.testing.assert_allclose(state.top_activations, -np.sort(-stacked, axis=0)[:3].T, rtol=1e-5)


def inspector(*args, check=True):
    result = subprocess.run([sys.executable, "-m", "inspector.cli", *args], capture_output=True, text=True,
                            timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_scan_command_writes_resumes_and_refuses_other_settings(compiled_server, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": d}) for d in DOCUMENTS))
    sae = write_sae(tmp_path / "res1", "jumprelu", 128, 512, "blocks.1.hook_resid_post", seed=2)
    out = tmp_path / "scan.h5"
    common = ["scan", "--server", compiled_server[0], "--corpus", str(corpus), "--sae", str(sae), "--out", str(out)]
    with connect(compiled_server[0]) as session:
        hooks = set(session.installed)
    summary = json.loads(inspector(*common, "--top", "5", "--json").stdout)
    assert summary["complete"] and summary["documents_done"] == len(DOCUMENTS) and summary["units"] == 512
    state, settings, vocabulary = read_scan(out)
    assert settings["hook"] == "blocks.1.hook_resid_post" and settings["sae"]["d_sae"] == 512
    windows = state.top_windows[state.top_windows >= 0]
    assert len(windows) and set(np.unique(windows).tolist()) <= set(vocabulary)
    again = inspector(*common, "--top", "5")
    assert "complete already" in again.stdout
    refused = inspector(*common, "--top", "7", check=False)
    assert refused.returncode == 1 and "other settings (top differ)" in refused.stderr
    with connect(compiled_server[0]) as session:
        assert set(session.installed) == hooks  # the shared server's hooks are as they were
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "x"}\n')
    refused = inspector("scan", "--corpus", str(bad), "--hook", "blocks.1.hook_resid_post", "--out",
                        str(tmp_path / "b.h5"), check=False)
    assert refused.returncode == 1 and 'line 1: a JSON object with a "text" field expected' in refused.stderr
    datasets = pytest.importorskip("datasets")  # the same documents as a datasets directory scan the same
    datasets.Dataset.from_dict({"text": DOCUMENTS}).save_to_disk(str(tmp_path / "ds"))
    inspector("scan", "--server", compiled_server[0], "--corpus", str(tmp_path / "ds"), "--sae", str(sae),
              "--out", str(tmp_path / "ds.h5"), "--top", "5")
    from_directory, _, _ = read_scan(tmp_path / "ds.h5")
    np.testing.assert_array_equal(from_directory.top_windows, state.top_windows)
