"""transformers' own implementation of an architecture, loaded with a GGUF file's weights (the reference)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from moestream.formats.gguf import GGUFFile
from moestream.runtime.loader import describe


def dequantized(f: GGUFFile, name: str) -> torch.Tensor:
    """A tensor dequantized by gguf's numpy code, independent of moestream's torch dequantization."""
    t = f.tensor(name)
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.qtype), dtype=np.float32)).reshape(t.shape)


def qwen3moe_reference(path: str) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with GGUFFile(path) as f:
        _, s = describe(f)
        tied = "output.weight" not in f.tensors
        config = Qwen3MoeConfig(
            vocab_size=s.n_vocab, hidden_size=s.n_embd, intermediate_size=s.n_ff_exp,
            num_hidden_layers=s.n_layer, num_attention_heads=s.n_head, num_key_value_heads=s.n_head_kv,
            head_dim=s.head_dim, max_position_embeddings=s.n_ctx_train, rms_norm_eps=s.rms_eps,
            rope_parameters={"rope_type": "default", "rope_theta": s.rope_base}, tie_word_embeddings=tied,
            num_experts=s.n_expert, num_experts_per_tok=s.n_expert_used, moe_intermediate_size=s.n_ff_exp,
            norm_topk_prob=True, decoder_sparse_step=1, attn_implementation="eager",
        )
        model = Qwen3MoeForCausalLM(config).float().eval()
        sd = {"model.embed_tokens.weight": dequantized(f, "token_embd.weight"),
              "model.norm.weight": dequantized(f, "output_norm.weight"),
              "lm_head.weight": dequantized(f, "token_embd.weight" if tied else "output.weight")}
        for il in range(s.n_layer):
            b, m = f"blk.{il}.", f"model.layers.{il}."
            sd |= {
                m + "input_layernorm.weight": dequantized(f, b + "attn_norm.weight"),
                m + "self_attn.q_proj.weight": dequantized(f, b + "attn_q.weight"),
                m + "self_attn.k_proj.weight": dequantized(f, b + "attn_k.weight"),
                m + "self_attn.v_proj.weight": dequantized(f, b + "attn_v.weight"),
                m + "self_attn.o_proj.weight": dequantized(f, b + "attn_output.weight"),
                m + "self_attn.q_norm.weight": dequantized(f, b + "attn_q_norm.weight"),
                m + "self_attn.k_norm.weight": dequantized(f, b + "attn_k_norm.weight"),
                m + "post_attention_layernorm.weight": dequantized(f, b + "ffn_norm.weight"),
                m + "mlp.gate.weight": dequantized(f, b + "ffn_gate_inp.weight"),
                m + "mlp.experts.gate_up_proj": torch.cat(
                    [dequantized(f, b + "ffn_gate_exps.weight"), dequantized(f, b + "ffn_up_exps.weight")], dim=1),
                m + "mlp.experts.down_proj": dequantized(f, b + "ffn_down_exps.weight"),
            }
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the reference, recomputing the whole sequence each step (no cache to get wrong)."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(torch.argmax(logits)))
    return seq[len(prompt):]
