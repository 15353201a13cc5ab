"""The headless command end to end on the built-in demo model (a real engine in a subprocess)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import hf_reference
from engines import assert_lens_matches
from inspector.io import read_run
from inspector.io.sweep import read_sweep


def inspector(*args, check=True):
    result = subprocess.run([sys.executable, "-m", "inspector.cli", *args], capture_output=True, text=True,
                            timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_capture_on_the_demo_model(tmp_path):
    out = tmp_path / "run.h5"
    result = inspector("capture", "--model", "demo", "--prompt", "def ", "--prompt", "import ",
                       "--hooks", "blocks.*.hook_resid_post", "blocks.0.mlp.hook_post", "blocks.*.attn.hook_*",
                       "--max-tokens", "6",
                       "--intervene", "blocks.1.hook_resid_post:scale=0.5,request=1", "--lens", "3", "--out", str(out),
                       "--json")
    summary = json.loads(result.stdout)
    assert "[compiling]" in result.stderr and "[ready]" in result.stderr
    assert "[generating] 12/12 tokens" in result.stderr  # progress on stderr: stdout is only the JSON
    run = read_run(out)
    assert summary["out"] == str(out) and len(summary["requests"]) == 2
    assert run.metadata["engine_mode"] == "compiled"
    layers = run.metadata["model_config"]["num_hidden_layers"]
    assert len(run.hooks) == 4 * layers + 1  # resid_post, q, k and z of every block; one layer's neurons
    for info, req in zip(summary["requests"], run.requests.values()):
        assert req.prompt == info["prompt"] and len(req.generated_token_ids) == 6
        assert "".join(req.token_texts[len(req.prompt_token_ids):]) == info["text"]
        for rows in req.hooks.values():
            assert rows.positions.tolist() == list(range(len(req.token_ids) - 1))
            assert np.all(np.isfinite(np.asarray(rows.values)))
    first, second = run.requests.values()
    assert first.intervention_log == [(0, [])]
    assert second.intervention_log[0][1][0]["scale"] == 0.5
    # the lens of every residual-stream row: transformers' final norm and head applied to the stored rows
    model = hf_reference.load(run.metadata["model_path"])
    norm = model.model.norm if hasattr(model, "model") else model.transformer.ln_f
    last = f"model.layers.{layers - 1}.resid_post"
    for req in run.requests.values():
        assert set(req.lens) == {h for h, info in run.hooks.items() if info.kind == "resid_post"}
        for hook, lens in req.lens.items():
            rows = req.hooks[hook]
            assert lens.column("positions").tolist() == rows.positions.tolist()
            assert lens.column("top_ids").shape == (len(rows), 3)
            assert lens.column("chosen_ids").tolist() == req.token_ids[1:len(rows) + 1]  # what came next
            with torch.no_grad():
                ref = torch.log_softmax(model.lm_head(norm(torch.from_numpy(np.asarray(rows.values)))), -1).numpy()
            assert_lens_matches(lens.column("top_ids"), lens.column("top_logprobs"), ref)
            chosen_ref = ref[np.arange(len(rows)), lens.column("chosen_ids")]
            np.testing.assert_allclose(lens.column("chosen_logprobs"), chosen_ref, rtol=1e-4)
        # the last block's lens at each generated token is the engine's own logprob of it
        generated = slice(len(req.prompt_token_ids) - 1, None)
        np.testing.assert_allclose(req.lens[last].column("chosen_logprobs")[generated], req.logprobs, atol=1e-4)
        # the file names every top token's text; greedy, the last block's top token is the one generated
        named = np.unique(np.concatenate([lens.column("top_ids") for lens in req.lens.values()]))
        assert set(named.tolist()) <= set(run.vocabulary)
        tops = req.lens[last].column("top_ids")[generated, 0].tolist()
        assert [run.vocabulary[t] for t in tops] == req.token_texts[len(req.prompt_token_ids):]
    # attention patterns from the file alone: every head of every layer is transformers' eager attention
    # (the second request's intervention at block 1's output changes blocks 2 and up: not compared there)
    for index, req in enumerate(run.requests.values()):
        reference = hf_reference.attention_patterns(run.metadata["model_path"], req.token_ids[:-1])
        for layer in range(layers if index == 0 else 2):
            npy = tmp_path / f"{index}-{layer}.npy"
            shown = json.loads(inspector("attention", str(out), "--request", str(index), "--layer", str(layer),
                                         "--out", str(npy), "--json").stdout)
            np.testing.assert_allclose(np.load(npy), reference[layer], atol=1e-5, rtol=0)
            last = len(req.token_ids) - 2
            assert shown["position"] == last and set(shown["top"]) == {str(h) for h in range(len(reference[layer]))}
            for head, ranked in shown["top"].items():
                assert [r["position"] for r in ranked] == np.argsort(-reference[layer][int(head), last],
                                                                     kind="stable")[:3].tolist()
                assert ranked[0]["token"] == req.token_texts[ranked[0]["position"]]
    refused = inspector("attention", str(out), "--layer", "99", check=False)
    assert refused.returncode == 1 and "queries and keys are captured for layers [0, 1, 2, 3]" in refused.stderr


def test_bad_input_exits_with_a_clear_message(tmp_path):
    result = inspector("capture", "--model", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "r.h5"),
                       check=False)
    assert result.returncode == 1 and "no config.json" in result.stderr
    result = inspector("capture", "--prompt", "x", "--intervene", "blocks.0.hook_resid_post:colour=red",
                       "--out", str(tmp_path / "r.h5"), check=False)
    assert result.returncode == 1 and "unknown key 'colour'" in result.stderr
    result = inspector("capture", "--prompt", "x", "--intervene", "blocks.0.hook_resid_post:positions=4-2",
                       "--out", str(tmp_path / "r.h5"), check=False)
    assert result.returncode == 1 and "runs backwards" in result.stderr
    result = inspector("capture", "--prompt", "x", "--window", "blocks.*=every:0", "--out", str(tmp_path / "r.h5"),
                       check=False)
    assert result.returncode == 1 and "--window 'blocks.*=every:0'" in result.stderr and "from 1 to" in result.stderr
    assert "[resolving]" not in result.stderr
    result = inspector("capture", "--prompt", "x", "--lens", "101", "--out", str(tmp_path / "r.h5"), check=False)
    assert result.returncode == 1 and "--lens takes K from 1 to 100" in result.stderr
    assert "[resolving]" not in result.stderr
    result = inspector("capture", "--prompt", "x", "--temperature", "-1", "--out", str(tmp_path / "r.h5"), check=False)
    assert result.returncode == 1 and "temperature must be 0 (greedy) or more" in result.stderr
    assert "[resolving]" not in result.stderr
    result = inspector("capture", "--prompt", "x", "--gpu-memory-utilization", "1.5", "--out", str(tmp_path / "r.h5"),
                       check=False)
    assert result.returncode == 1 and "--gpu-memory-utilization must be in (0, 1], got 1.5" in result.stderr
    assert not (tmp_path / "r.h5").exists()


def test_a_bad_output_path_is_refused_before_the_engine_boots(tmp_path):
    result = inspector("capture", "--prompt", "x", "--out", str(tmp_path / "missing" / "x.h5"), check=False)
    assert result.returncode == 1 and "the directory" in result.stderr and "does not exist" in result.stderr
    assert "[resolving]" not in result.stderr  # no engine was started


def test_version():
    out = inspector("--version").stdout
    assert out.startswith("Activation Inspector ") and "vLLM " in out and "torch " in out


def test_the_apps_own_server_command_carries_every_session_option():
    """What the app gives its own server (``serve_command``) reads back, through the CLI's own parser,
    as the very options (a server's session keeps no rows: its client does)."""
    import dataclasses

    from inspector.core.protocol import SessionOptions
    from inspector.cli import build_parser
    from inspector.cli.serve import served_options
    from inspector.client.local import serve_command

    options = SessionOptions(model="/models/tiny", mode="eager", hooks=("blocks.0.*", "ln_final.hook_normalized"),
                             dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=256,
                             enable_position_interventions=False, retain_rows=False, max_slots=8, feature_clamps=4,
                             windows=(("*", "generated"), ("blocks.1.*", "last:3")), kept_layers=2,
                             engine_args={"tensor_parallel_size": 2, "seed": 3})
    defaults = SessionOptions()
    assert [f.name for f in dataclasses.fields(options) if getattr(options, f.name) == getattr(defaults, f.name)] == []
    command = serve_command(options, "ipc:///tmp/inspector-test.sock")
    assert command[:4] == [sys.executable, "-m", "inspector.cli", "serve"]
    args = build_parser().parse_args(command[3:])
    assert served_options(args) == options and args.listen == "ipc:///tmp/inspector-test.sock"
    assert served_options(build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])).engine_args == {
        "tensor_parallel_size": 2}


def test_a_harvest_names_its_hooks_where_captures_have_a_default(capsys):
    """A harvest writes every row of each hook it takes: it has no default set of hooks, and its help
    promises none (it had printed the capture commands' default, then refused without --hooks)."""
    from inspector.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["harvest", "--corpus", "c.txt", "--out", "o"])
    assert exited.value.code == 2 and "required: --hooks" in capsys.readouterr().err
    named = parser.parse_args(["harvest", "--corpus", "c.txt", "--out", "o", "--hooks", "blocks.1.*"])
    assert named.hooks == ["blocks.1.*"]
    assert parser.parse_args(["capture", "--prompt", "x", "--out", "o.h5"]).hooks is None  # the default applies


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_hooks_lists_the_catalogue(fmt):
    result = inspector("hooks", "--model", "demo", *(["--json"] if fmt == "json" else []))
    if fmt == "json":
        points = json.loads(result.stdout)
        assert {p["kind"] for p in points} >= {"resid_post", "attn_out", "mlp_post", "embed", "normalized"}
    else:
        assert "blocks.0.hook_resid_post" in result.stdout and "model.layers.0.resid_post" in result.stdout
        assert result.stdout.startswith("block family: fused (LlamaDecoderLayer), read from its forward\n")


def test_patch_writes_a_sweep_file_on_a_server(compiled_server, tmp_path):
    """On the shared test server (no boot of its own): every layer's resid_post, denoising."""
    url = compiled_server[0]
    out = tmp_path / "sweep.h5"
    common = ["patch", "--server", url, "--kind", "resid_post", "--clean", "def f(a, b):",
              "--corrupted", "def g(a, b):", "--out", str(out)]
    summary = json.loads(inspector(*common, "--answer", " the", "--foil", " a", "--json").stdout)
    result, metadata = read_sweep(out)
    assert summary["out"] == str(out) and summary["complete"] and summary["engine_calls"] == 1
    assert result.hooks == ["model.layers.0.resid_post", "model.layers.1.resid_post"] and result.complete
    assert summary["cells"] == result.raw.size == 2 * len(result.token_ids["clean"])
    assert metadata["engine_mode"] == "compiled" and result.spec.metric.foil is not None
    np.testing.assert_allclose(result.normalized, (result.raw - result.corrupted_metric)
                               / (result.clean_metric - result.corrupted_metric))
    best = summary["top_cells"][0]
    assert best["normalized"] == np.nanmax(result.normalized)
    refused = inspector(*common, "--answer", " dog", check=False)
    assert refused.returncode == 1 and "' dog' is 3 tokens" in refused.stderr and not refused.stdout
    refused = inspector(*common, "--answer", " the", "--kind", "mlp_out", check=False)
    assert refused.returncode == 1 and "add --hooks blocks.*.hook_mlp_out" in refused.stderr


def test_capture_compare_marks_twins_in_the_file(compiled_server, tmp_path):
    out = tmp_path / "compare.h5"
    summary = json.loads(inspector("capture", "--server", compiled_server[0], "--compare", "--prompt", "def f(",
                                   "--prompt", "import ", "--max-tokens", "4", "--intervene",
                                   "blocks.0.hook_resid_post:scale=0.5", "--out", str(out), "--json").stdout)
    run = read_run(out)
    assert [r.get("twin_role") for r in summary["requests"]] == ["clean", "intervened"] * 2
    for clean, steered in zip(list(run.requests.values())[0::2], list(run.requests.values())[1::2]):
        assert (clean.twin_role, clean.twin_of, steered.twin_role, steered.twin_of) == (
            "clean", steered.request_id, "intervened", clean.request_id)
        assert clean.prompt == steered.prompt and clean.sampling["seed"] == steered.sampling["seed"]
        assert clean.intervention_log == [(0, [])] and steered.intervention_log[0][1][0]["scale"] == 0.5


def test_capture_with_an_sae_stores_each_tokens_strongest_features(compiled_server, tmp_path):
    from sae_files import saelens_encode, write_sae

    from inspector.core.sae import strongest

    sae = write_sae(tmp_path / "res1", "topk", 128, 1024, "blocks.1.hook_resid_post", k=12)
    out = tmp_path / "features.h5"
    inspector("capture", "--server", compiled_server[0], "--prompt", "def f(a, b):", "--max-tokens", "4",
              "--sae", str(sae), "--sae-k", "8", "--out", str(out))
    run = read_run(out)
    assert [s["hook"] for s in run.metadata["saes"]] == ["model.layers.1.resid_post"]
    (req,) = run.requests.values()
    rows, features = req.hooks["model.layers.1.resid_post"], req.features["res1"]
    ids, acts = strongest(saelens_encode(sae, np.asarray(rows.values)), 8)
    np.testing.assert_array_equal(features.positions, np.asarray(rows.positions))
    np.testing.assert_array_equal(features.ids, ids)
    np.testing.assert_allclose(features.activations, acts, rtol=1e-5, atol=1e-6)
    refused = inspector("capture", "--model", "demo", "--prompt", "x", "--sae", str(tmp_path), "--out",
                        str(tmp_path / "no.h5"), check=False)
    assert refused.returncode == 1 and "no cfg.json" in refused.stderr


def test_capture_clamps_a_feature_of_an_sae_it_attached(compiled_server, tmp_path):
    """--compare runs the prompt clean and clamped side by side: the clamped twin's prompt rows at the
    SAE's hook are the clean ones with the feature set to the value (the SAE's reconstruction with it,
    plus its error)."""
    from sae_files import write_sae

    from inspector.core.sae import encode, load_weights, read_sae

    sae = write_sae(tmp_path / "relu", "jumprelu", 128, 512, "blocks.1.hook_resid_post", seed=3)
    out = tmp_path / "clamped.h5"
    inspector("capture", "--server", compiled_server[0], "--prompt", "def f(a, b):", "--max-tokens", "3",
              "--sae", str(sae), "--clamp-feature", "relu:7=2.5", "--compare", "--out", str(out))
    clean, clamped = read_run(out).requests.values()
    assert (clean.twin_role, clamped.twin_role) == ("clean", "intervened")
    (logged,) = clamped.intervention_log[0][1]
    assert logged["clamp"]["label"] == "relu/7" and logged["clamp"]["value"] == 2.5
    hook, n = "model.layers.1.resid_post", len(clean.prompt_token_ids)
    rows = np.asarray(clean.hooks[hook].values)[:n]
    config, weights = read_sae(sae), load_weights(read_sae(sae))
    want = rows + (2.5 - encode(config, weights, rows)[:, 7])[:, None] * weights["W_dec"][7]
    np.testing.assert_allclose(np.asarray(clamped.hooks[hook].values)[:n], want, rtol=1e-5, atol=1e-5)
    for bad, message in (("relu7=2", "expected SAE:FEATURE=NUMBER"), ("other:7=2", "other, not an --sae")):
        refused = inspector("capture", "--server", compiled_server[0], "--prompt", "x", "--sae", str(sae),
                            "--clamp-feature", bad, "--out", str(tmp_path / "no.h5"), check=False)
        assert refused.returncode == 1 and message in refused.stderr


def test_capture_windows_keep_the_rows_they_promise_in_the_file(compiled_server, tmp_path):
    """On the shared test server: the windowed file's rows are the all-window file's at the kept positions."""
    from inspector.core.windows import CaptureWindow

    common = ["capture", "--server", compiled_server[0], "--prompt", "def f(a, b):", "--prompt", "import ",
              "--max-tokens", "4"]
    inspector(*common, "--out", str(tmp_path / "all.h5"))
    summary = json.loads(inspector(*common, "--window", "generated", "--window", "blocks.0.*=every:2",
                                   "--out", str(tmp_path / "windowed.h5"), "--json").stdout)
    assert summary["windows"] == {"model.layers.0.resid_post": "every:2", "model.layers.1.resid_post": "generated",
                                  "model.embed_tokens.embed": "generated"}
    whole, windowed = read_run(tmp_path / "all.h5"), read_run(tmp_path / "windowed.h5")
    for want, got in zip(whole.requests.values(), windowed.requests.values()):
        assert got.windows == summary["windows"]
        for hook, rows in want.hooks.items():
            keep = CaptureWindow.parse(got.windows[hook]).keeps(rows.positions, len(want.prompt_token_ids))
            assert got.hooks[hook].positions.tolist() == rows.positions[keep].tolist()
            np.testing.assert_array_equal(got.hooks[hook].values[:], rows.values[:][keep])
