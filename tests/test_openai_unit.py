"""The OpenAI server's admission, without an engine: steering fields → edits, the edit string, salts, slots."""

import json

import numpy as np
import pytest

from inspector.core.hooks import HookPoint
from inspector.core.interventions import Intervention
from inspector.core.request_edits import CAPTURE_KEY, EDIT_KEY, decode_edit, encode_edit, encode_vector, fingerprint
from inspector.openai.admission import Admission
from inspector.openai.steering import HookTable, Refused
from inspector.openai.vectors import absolute_vector_spec, parse_vector_spec, split_vector_spec
from inspector.plugin.config import served_config

WIDTH = 8
RNG = np.random.default_rng(0)
HAPPY = RNG.normal(size=WIDTH).astype(np.float32)


def hook_table(max_slots=4, feature_clamps=1):
    points = {f"model.layers.{i}.resid_post": HookPoint(f"model.layers.{i}.resid_post", f"blocks.{i}.hook_resid_post",
                                                        f"model.layers.{i}", "resid_post", WIDTH, i)
              for i in range(2)}
    return HookTable(points, "float32", max_slots, 64, "compiled", feature_clamps)


@pytest.fixture
def admission():
    found = Admission()
    found.hooks = hook_table()
    found.vectors.add("happy", "model.layers.1.resid_post", HAPPY, "test", found.hooks.widths)
    return found


def body(**xargs):
    return json.dumps({"model": "m", "prompt": "hi", **({"vllm_xargs": xargs} if xargs else {})}).encode()


def admitted(admission, raw):
    ticket = admission.admit(raw)
    return json.loads(ticket.body), ticket.fingerprint


def test_named_vector_becomes_a_scaled_edit_with_a_content_salt(admission):
    data, found = admitted(admission, body(inspector_steer="happy", inspector_scale=2.5, inspector_positions="1-3",
                                           other_field=7))
    assert data["vllm_xargs"].keys() == {EDIT_KEY, "other_field"}  # our fields rewritten, others kept
    [iv] = decode_edit(data["vllm_xargs"][EDIT_KEY], "r1")
    assert iv.hook == "model.layers.1.resid_post" and iv.request_id == "r1" and iv.positions == (1, 2, 3)
    np.testing.assert_array_equal(iv.bias, (HAPPY * 2.5).astype(np.float32))  # the engine holds float32 at most
    assert found == fingerprint(data["vllm_xargs"][EDIT_KEY]) and data["cache_salt"].startswith("i-")


def test_same_contents_share_a_salt_whatever_their_name(admission):
    inline = f"blocks.1.hook_resid_post:{encode_vector(HAPPY)}"
    by_name, _ = admitted(admission, body(inspector_steer="happy"))
    by_value, _ = admitted(admission, body(inspector_vector=inline))
    other, _ = admitted(admission, body(inspector_steer="happy", inspector_scale=2))
    assert by_name["cache_salt"] == by_value["cache_salt"] != other["cache_salt"]
    assert by_name["vllm_xargs"] == by_value["vllm_xargs"]


def test_client_salts_live_in_their_own_namespace(admission):
    plain, found = admitted(admission, json.dumps({"prompt": "x", "cache_salt": "team-a"}).encode())
    assert plain["cache_salt"] == "c-team-a" and found is None
    long, _ = admitted(admission, json.dumps({"prompt": "x", "cache_salt": "y" * 128}).encode())
    assert long["cache_salt"].startswith("h-") and len(long["cache_salt"]) <= 128
    steered_a, _ = admitted(admission, json.dumps({"cache_salt": "a", "vllm_xargs": {"inspector_steer": "happy"}}).encode())
    steered_b, _ = admitted(admission, json.dumps({"cache_salt": "b", "vllm_xargs": {"inspector_steer": "happy"}}).encode())
    assert steered_a["cache_salt"] != steered_b["cache_salt"] and steered_a["cache_salt"].startswith("i-")
    untouched = json.dumps({"prompt": "x"}).encode()
    assert admission.admit(untouched).body is untouched  # unsteered, no salt: as it came (cache hits kept)


@pytest.mark.parametrize("xargs, field, words", [
    ({"inspector_steer": "sad"}, "inspector_steer", "no vector named 'sad'"),
    ({"inspector_stear": "happy"}, "inspector_stear", "unknown steering field"),
    ({EDIT_KEY: "[]"}, EDIT_KEY, "written by the server"),
    ({CAPTURE_KEY: "all"}, CAPTURE_KEY, "written by the server"),
    ({"inspector_capture": "blocks.7.*"}, "inspector_capture", "matches no hook"),
    ({"inspector_capture": "blocks.*", "inspector_window": "last:0"}, "inspector_window", "whole number"),
    ({"inspector_window": "generated"}, "inspector_window", "without inspector_capture"),
    ({"inspector_steer": "happy", "inspector_scale": "lots"}, "inspector_scale", "must be a number"),
    ({"inspector_steer": "happy", "inspector_scale": "nan"}, "inspector_scale", "finite"),
    ({"inspector_steer": "happy", "inspector_positions": "3-1"}, "inspector_positions", "backwards"),
    ({"inspector_steer": "happy", "inspector_positions": [1, -2]}, "inspector_positions", "whole numbers"),
    ({"inspector_steer": "happy", "inspector_positions": "60-70"}, "inspector_positions", "out of range"),
    ({"inspector_scale": 2}, "inspector_steer", "without a vector"),
    ({"inspector_vector": "blocks.1.hook_resid_post"}, "inspector_vector", "HOOK:BASE64"),
    ({"inspector_vector": "blocks.9.hook_resid_post:AAAA"}, "inspector_vector", "not a hook this server compiled"),
    ({"inspector_vector": "blocks.1.hook_resid_post:%%%"}, "inspector_vector", "not base64"),
    ({"inspector_vector": "blocks.1.hook_resid_post:" + encode_vector(np.ones(WIDTH * 50))}, "inspector_vector",
     "longer than 8"),
    ({"inspector_vector": "blocks.1.hook_resid_post:" + encode_vector(np.ones(3))}, None, "3 values"),
    ({"inspector_vector": "blocks.1.hook_resid_post:" + encode_vector(np.full(WIDTH, np.inf))}, None, "NaN/Inf"),
])
def test_bad_fields_are_refused_with_a_reason(admission, xargs, field, words):
    with pytest.raises(Refused) as refused:
        admission.admit(body(**xargs))
    assert refused.value.status == 400 and refused.value.field == field and words in str(refused.value)


def test_a_bad_client_salt_on_a_steered_request_is_refused(admission):
    with pytest.raises(Refused, match="cache_salt"):
        admission.admit(json.dumps({"cache_salt": "a/b", "vllm_xargs": {"inspector_steer": "happy"}}).encode())


def test_distinct_edits_beyond_the_slots_wait_for_a_retry(admission):
    running = [admission.admit(body(inspector_steer="happy", inspector_scale=s)).fingerprint for s in (1, 2, 3)]
    assert admission.admit(body(inspector_steer="happy", inspector_scale=1)).fingerprint == running[0]  # shares a slot
    with pytest.raises(Refused) as refused:
        admission.admit(body(inspector_steer="happy", inspector_scale=4))
    assert refused.value.status == 429 and "max_slots 4" in str(refused.value)
    admission.release(running[1])
    admission.admit(body(inspector_steer="happy", inspector_scale=4))
    admission.release(running[0])  # still one request of it running: its slot stays taken
    with pytest.raises(Refused):
        admission.admit(body(inspector_steer="happy", inspector_scale=5))


def test_a_server_without_hooks_refuses_steering_but_serves_the_rest():
    bare = Admission()
    plain = body()
    assert bare.admit(plain).body is plain
    with pytest.raises(Refused, match="additional-config"):
        bare.admit(body(inspector_steer="happy"))


def test_edit_string_round_trip_and_fingerprint_are_stable():
    ivs = [Intervention("h", scale=2.0, bias=HAPPY, positions=(0, 4)), Intervention("g", bias=0.5)]
    text = encode_edit(ivs)
    assert text == encode_edit(list(ivs)) and fingerprint(text) == fingerprint(encode_edit(ivs))
    back = decode_edit(text, "r")
    assert [iv.effect for iv in back] == [iv.effect for iv in ivs]
    assert all(iv.request_id == "r" for iv in back)


def test_vector_specs(tmp_path):
    np.save(tmp_path / "v.npy", HAPPY)
    assert split_vector_spec("a=x.npy@blocks.1.hook_resid_post") == ("a", "x.npy", "@", "blocks.1.hook_resid_post")
    assert absolute_vector_spec(f"a={tmp_path}/v.npy@h").endswith("/v.npy@h")
    spec = parse_vector_spec(f"a={tmp_path / 'v.npy'}@h")
    assert (spec.name, spec.hook, spec.clamp) == ("a", "h", None) and np.array_equal(spec.vector, HAPPY)
    for bad, words in [("a", "NAME=FILE@HOOK"), ("a b=x@h", "vector name"), ("a=x.npy", "NAME=FILE@HOOK"),
                       ("a=dir#x", "must be a number"), (f"a={tmp_path}/none.npy@h", "cannot read")]:
        with pytest.raises(ValueError, match=words):
            parse_vector_spec(bad)


def test_served_config_reads_the_inspector_section():
    config = served_config({"hooks": ["blocks.*"], "max_slots": 8, "vectors": []}, "bfloat16", 256, eager=False)
    assert (config.hook_patterns, config.max_slots, config.dtype, config.capture_rows,
            config.enable_position_interventions, config.eager) == (("blocks.*",), 8, "bfloat16", False, True, False)
    with pytest.raises(ValueError, match="unknown fields"):
        served_config({"hookz": []}, "float32", 256, eager=False)
    with pytest.raises(ValueError, match="max_slots must be a JSON int"):
        served_config({"max_slots": "8"}, "float32", 256, eager=False)
    with pytest.raises(ValueError, match="max_slots must be between"):
        served_config({"max_slots": 1}, "float32", 256, eager=False)


def test_a_capturing_request_gets_a_key_its_window_and_no_cache_reads(admission):
    ticket = admission.admit(body(inspector_capture="blocks.1.*", inspector_window="last:2", inspector_steer="happy"))
    data = json.loads(ticket.body)
    assert ticket.capture.hooks == ("model.layers.1.resid_post",) and ticket.capture.window == "last:2"
    assert data["vllm_xargs"][CAPTURE_KEY] == "last:2" and EDIT_KEY in data["vllm_xargs"]
    assert data["cache_salt"] == "x-" + ticket.key and data["return_token_ids"] is True
    other = admission.admit(body(inspector_capture="blocks.*"))
    assert other.key != ticket.key and other.capture.hooks == tuple(f"model.layers.{i}.resid_post" for i in range(2))


def test_an_ablation_is_a_clamp_of_the_unit_direction_to_zero(admission):
    data, _ = admitted(admission, body(inspector_ablate="happy", inspector_positions=[3]))
    [iv] = decode_edit(data["vllm_xargs"][EDIT_KEY], "r")
    unit = HAPPY / np.linalg.norm(HAPPY)
    np.testing.assert_allclose(iv.clamp.encoder, unit, rtol=1e-6)
    np.testing.assert_allclose(iv.clamp.decoder, unit, rtol=1e-6)
    assert (iv.clamp.value, iv.clamp.offset, iv.positions) == (0.0, 0.0, (3,)) and iv.clamp.floor < -1e29
    x = RNG.normal(size=WIDTH)  # what the engine computes: x + (value - a(x)) * decoder
    p = x @ iv.clamp.encoder + iv.clamp.offset
    assert abs((x + (0.0 - p) * iv.clamp.decoder) @ unit) < 1e-6


def test_clamps_share_the_hooks_clamp_room(admission):
    sad = -HAPPY
    first = admission.admit(body(inspector_ablate="happy"))
    assert admission.admit(body(inspector_ablate="happy", inspector_positions=[5])).fingerprint != first.fingerprint
    with pytest.raises(Refused) as full:  # a second direction at the hook: room for one (feature_clamps 1)
        admission.admit(body(inspector_ablate=f"blocks.1.hook_resid_post:{encode_vector(sad + 1)}"))
    assert full.value.status == 429 and "retry" in str(full.value)
    admission.admit(body(inspector_ablate=f"blocks.0.hook_resid_post:{encode_vector(sad)}"))  # another hook: room
    admission.release(first.fingerprint)
    with pytest.raises(Refused):  # the position-5 request clamps the same direction and still runs
        admission.admit(body(inspector_ablate=f"blocks.1.hook_resid_post:{encode_vector(sad + 1)}"))
    with pytest.raises(Refused) as never:
        admission.admit(body(inspector_ablate=["happy", f"blocks.1.hook_resid_post:{encode_vector(sad + 1)}"]))
    assert never.value.status == 400  # more than the room on its own: it never fits


def test_clamps_need_room_and_an_sae_feature(admission):
    admission.hooks = hook_table(feature_clamps=0)
    with pytest.raises(Refused, match="--feature-clamps"):
        admission.admit(body(inspector_ablate="happy"))
    admission.hooks = hook_table()
    with pytest.raises(Refused, match="cannot be clamped: it is not an SAE feature"):
        admission.admit(body(inspector_clamp="happy=2"))
    with pytest.raises(Refused, match="NAME=VALUE"):
        admission.admit(body(inspector_clamp="happy"))
    with pytest.raises(Refused, match="no direction"):
        admission.admit(body(inspector_ablate=f"blocks.1.hook_resid_post:{encode_vector(np.zeros(WIDTH))}"))


def test_points_split_over_ranks_are_not_captured(admission):
    from dataclasses import replace

    points = dict(admission.hooks.points)
    points["model.layers.0.mlp.post"] = HookPoint("model.layers.0.mlp.post", "blocks.0.mlp.hook_post",
                                                  "model.layers.0.mlp", "mlp_post", 32, 0, shards=2)
    admission.hooks = replace(admission.hooks, points=points)
    with pytest.raises(Refused, match="split over the tensor-parallel ranks"):
        admission.admit(body(inspector_capture="blocks.0.*"))
    assert admission.admit(body(inspector_capture="blocks.0.hook_resid_post")).key


def test_serving_refuses_to_start_without_the_plugins_it_needs(monkeypatch):
    """vLLM would log a plugin that fails to load and serve every steered request unsteered."""
    from importlib.metadata import EntryPoint

    from inspector.openai import cli

    cli.require_plugins()  # the installed package's own entry points load
    broken = EntryPoint(name=cli.PLUGIN, value='"inspector.plugin:register"', group="vllm.general_plugins")
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken] if group == broken.group else [])
    with pytest.raises(RuntimeError, match="general_plugins entry point '\"inspector.plugin:register\"' does not"):
        cli.require_plugins()
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    with pytest.raises(RuntimeError, match="vllm.general_plugins entry point is not installed"):
        cli.require_plugins()


def test_engine_arguments_that_are_the_servers_own_options_are_refused_before_vllm_starts():
    """vllm serve would take the later of two --max-num-batched-tokens without a word."""
    from inspector.cli import build_parser
    from inspector.cli.serve import _engine_args
    from inspector.openai.cli import vllm_arguments

    args = build_parser().parse_args(["serve", "--openai", "--engine-args", '{"max_num_batched_tokens": 64}'])
    with pytest.raises(ValueError, match="max_num_batched_tokens are the session's own options"):
        vllm_arguments(args, _engine_args(args))
    plain = build_parser().parse_args(["serve", "--openai", "--hooks", "blocks.0.*", "--engine-args", '{"seed": 3}'])
    assert vllm_arguments(plain, _engine_args(plain))[-2:] == ["--seed", "3"]


def test_a_worker_says_once_that_requests_bring_fields_no_middleware_read(caplog, monkeypatch):
    """A server whose endpoint plugin did not load passes a client's fields straight to the engine:
    the worker cannot refuse the request, so it logs why it runs unsteered (once, not per request)."""
    from inspector.plugin import worker_extension

    monkeypatch.setattr(worker_extension, "_unread_reported", False)
    calls = []

    class Runtime:  # the two calls the worker makes with what requests carry
        config = served_config({}, "float32", 64, False)

        def set_request_edits(self, edits, finished):
            calls.append(edits)

        def set_request_options(self, options, forget):
            calls.append(options)

    new = {"a": ({"inspector_steer": "happy", "top_k": 3}, 4), "b": ({"inspector_capture": "blocks.*"}, 4)}
    with caplog.at_level("ERROR", logger=worker_extension.__name__):
        worker_extension._read_requests(Runtime(), new, set())
        worker_extension._read_requests(Runtime(), {"c": ({"inspector_scale": 2.0}, 4)}, set())
    assert caplog.text.count("endpoint plugin") == 1 and "inspector_steer" in caplog.text
    assert calls[:2] == [{}, {"a": {"capture": False}, "b": {"capture": False}}]  # unsteered, no rows kept
