"""Write a transformers Llama/Qwen model to a GGUF file the way llama.cpp's converter does
(q/k rows permuted for Llama; some tensors quantized), for loading tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_gguf(model: torch.nn.Module, path: Path, arch: str = "llama",
               quantize: tuple[str, ...] = ("ffn_up", "ffn_down")) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize as q

    cfg = model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            parts = name.split(".")
            layer, rest = parts[2], ".".join(parts[3:-1])
            gname = f"blk.{layer}.{names[rest]}.{parts[-1]}"
            if arch == "llama" and names[rest] == "attn_q":
                a = _permute(a, cfg.num_attention_heads)
            elif arch == "llama" and names[rest] == "attn_k":
                a = _permute(a, cfg.num_key_value_heads)
        if any(f".{k}." in gname for k in quantize) and a.ndim == 2:
            w.add_tensor(gname, q(a, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
