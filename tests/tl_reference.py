"""TransformerLens's ``HookedTransformer`` on a tiny model the tests built, its weights converted by
TransformerLens's own converters and loaded without processing (no folded norms, no centring: what
``from_pretrained_no_processing`` does; the hubs it would read the config from are unreachable)."""

import json
from pathlib import Path

import torch


def hooked_transformer(model_dir, arch: str):
    from transformers import AutoModelForCausalLM
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained import weight_conversions

    c = json.loads((Path(model_dir) / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if arch == "llama":
        shape = dict(d_model=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
                     d_head=c["head_dim"], d_mlp=c["intermediate_size"], n_ctx=c["max_position_embeddings"],
                     act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
                     rotary_dim=c["head_dim"], rotary_base=c["rope_parameters"]["rope_theta"], gated_mlp=True,
                     final_rms=True, eps=c["rms_norm_eps"], n_key_value_heads=c["num_key_value_heads"],
                     original_architecture="LlamaForCausalLM")
        convert = weight_conversions.convert_llama_weights
    elif arch == "gpt2":
        shape = dict(d_model=c["n_embd"], n_layers=c["n_layer"], n_heads=c["n_head"], d_head=c["n_embd"] // c["n_head"],
                     d_mlp=c["n_inner"], n_ctx=c["n_positions"], act_fn=c["activation_function"],
                     normalization_type="LN", eps=c["layer_norm_epsilon"], original_architecture="GPT2LMHeadModel")
        convert = weight_conversions.convert_gpt2_weights
    else:
        raise ValueError(f"no TransformerLens reference for {arch}")
    cfg = HookedTransformerConfig(**shape, d_vocab=c["vocab_size"], default_prepend_bos=False, dtype=torch.float32)
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(convert(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False,
                                      refactor_factored_attn_matrices=False)
    return model.eval()
