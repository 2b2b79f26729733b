"""transformers' own implementation of an architecture, loaded with a GGUF file's weights (the reference)."""

from __future__ import annotations

import inspect

import gguf
import numpy as np
import torch

from moestream.formats.gguf import GGUFFile
from moestream.models.describe import describe


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max())


def prompt_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, n_vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def dequantized(f: GGUFFile, name: str) -> torch.Tensor:
    """A tensor dequantized by gguf's numpy code, independent of moestream's torch dequantization."""
    t = f.tensor(name)
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.qtype), dtype=np.float32)).reshape(t.shape)


def common_config(s, tied: bool) -> dict:
    """The transformers config fields both MoE architectures take from the same spec values."""
    return dict(
        vocab_size=s.n_vocab,
        hidden_size=s.n_embd,
        num_hidden_layers=s.n_layer,
        num_attention_heads=s.n_head,
        num_key_value_heads=s.n_head_kv,
        head_dim=s.head_dim,
        max_position_embeddings=s.n_ctx_train,
        rms_norm_eps=s.rms_eps,
        tie_word_embeddings=tied,
        num_experts=s.n_expert,
        num_experts_per_tok=s.n_expert_used,
        moe_intermediate_size=s.n_ff_exp,
    )


def qwen3moe_reference(path: str) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with GGUFFile(path) as f:
        _, s = describe(f)
        tied = "output.weight" not in f.tensors
        config = Qwen3MoeConfig(
            **common_config(s, tied),
            intermediate_size=s.n_ff_exp,
            rope_parameters={"rope_type": "default", "rope_theta": s.rope_base},
            norm_topk_prob=True,
            decoder_sparse_step=1,
            attn_implementation="eager",
        )
        model = Qwen3MoeForCausalLM(config).float().eval()
        sd = {
            "model.embed_tokens.weight": dequantized(f, "token_embd.weight"),
            "model.norm.weight": dequantized(f, "output_norm.weight"),
            "lm_head.weight": dequantized(f, "token_embd.weight" if tied else "output.weight"),
        }
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
                    [dequantized(f, b + "ffn_gate_exps.weight"), dequantized(f, b + "ffn_up_exps.weight")],
                    dim=1,
                ),
                m + "mlp.experts.down_proj": dequantized(f, b + "ffn_down_exps.weight"),
            }
    missing, unexpected = model.load_state_dict(sd, strict=True)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model


def qwen35moe_reference(path: str) -> torch.nn.Module:
    """transformers' Qwen3.5-MoE text model (Qwen3_5MoeForCausalLM) with the file's weights, in float32.

    The GGUF layout differs from transformers' in three ways, undone here:
    - RMSNorm weights are stored as 1 + w (transformers adds the 1 itself), except the gated norm ssm_norm;
    - delta-net value heads are stored tiled over the key heads (v head j*Hk + k reads key head k) where
      transformers groups them (v head k*r + j, r = Hv/Hk): every per-value-head row, channel or column is
      permuted back with `grouped`;
    - ssm_a holds -exp(A_log).
    attn_q's per-head [q_h | gate_h] rows are transformers' q_proj layout as is.
    """
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    # Where flash-linear-attention is installed (moestream[fla]), transformers swaps these for fla's Triton
    # kernels, which cannot take the CPU tensors of this reference: keep transformers' own torch forms.
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))

    with GGUFFile(path) as f:
        _, s = describe(f)
        e = s.extra
        tied = "output.weight" not in f.tensors
        hk, hv, dv = e["k_heads"], e["v_heads"], e["v_dim"]
        config = Qwen3_5MoeTextConfig(
            **common_config(s, tied),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": s.rope_base,
                "partial_rotary_factor": s.rot_dim / s.head_dim,
                "mrope_section": list(e["rope_sections"][:3]),
                "mrope_interleaved": True,
            },
            layer_types=["linear_attention" if r else "full_attention" for r in e["recurrent_layers"]],
            linear_conv_kernel_dim=e["conv_kernel"],
            linear_key_head_dim=e["k_dim"],
            linear_value_head_dim=dv,
            linear_num_key_heads=hk,
            linear_num_value_heads=hv,
            shared_expert_intermediate_size=s.n_ff_shexp,
            attn_implementation="eager",
        )
        model = Qwen3_5MoeForCausalLM(config).float().eval()

        def w(name: str) -> torch.Tensor:
            return dequantized(f, name)

        def norm(name: str) -> torch.Tensor:
            return w(name) - 1

        def grouped(t: torch.Tensor, per_head: int) -> torch.Tensor:
            """Value heads of `per_head` rows each along dim 0, from tiled to transformers' grouped order."""
            rest = t.shape[1:]
            return t.reshape(hv // hk, hk, per_head, *rest).transpose(0, 1).reshape(t.shape)

        sd = {
            "model.embed_tokens.weight": w("token_embd.weight"),
            "model.norm.weight": norm("output_norm.weight"),
            "lm_head.weight": w("token_embd.weight" if tied else "output.weight"),
        }
        for il in range(s.n_layer):
            b, m = f"blk.{il}.", f"model.layers.{il}."
            sd |= {
                m + "input_layernorm.weight": norm(b + "attn_norm.weight"),
                m + "post_attention_layernorm.weight": norm(b + "post_attention_norm.weight"),
                m + "mlp.gate.weight": w(b + "ffn_gate_inp.weight"),
                m + "mlp.experts.gate_up_proj": torch.cat(
                    [w(b + "ffn_gate_exps.weight"), w(b + "ffn_up_exps.weight")], dim=1
                ),
                m + "mlp.experts.down_proj": w(b + "ffn_down_exps.weight"),
                m + "mlp.shared_expert.gate_proj.weight": w(b + "ffn_gate_shexp.weight"),
                m + "mlp.shared_expert.up_proj.weight": w(b + "ffn_up_shexp.weight"),
                m + "mlp.shared_expert.down_proj.weight": w(b + "ffn_down_shexp.weight"),
                m + "mlp.shared_expert_gate.weight": w(b + "ffn_gate_inp_shexp.weight").reshape(1, -1),
            }
            if not e["recurrent_layers"][il]:
                a = m + "self_attn."
                sd |= {
                    a + "q_proj.weight": w(b + "attn_q.weight"),
                    a + "k_proj.weight": w(b + "attn_k.weight"),
                    a + "v_proj.weight": w(b + "attn_v.weight"),
                    a + "o_proj.weight": w(b + "attn_output.weight"),
                    a + "q_norm.weight": norm(b + "attn_q_norm.weight"),
                    a + "k_norm.weight": norm(b + "attn_k_norm.weight"),
                }
                continue
            qk = 2 * hk * e["k_dim"]  # q and k channels lead attn_qkv and the conv; value channels follow
            qkv, conv = w(b + "attn_qkv.weight"), w(b + "ssm_conv1d.weight")
            a = m + "linear_attn."
            sd |= {
                a + "in_proj_qkv.weight": torch.cat([qkv[:qk], grouped(qkv[qk:], dv)]),
                a + "conv1d.weight": torch.cat([conv[:qk], grouped(conv[qk:], dv)]).unsqueeze(1),  # [C, 1, K]
                a + "in_proj_z.weight": grouped(w(b + "attn_gate.weight"), dv),
                a + "in_proj_a.weight": grouped(w(b + "ssm_alpha.weight"), 1),
                a + "in_proj_b.weight": grouped(w(b + "ssm_beta.weight"), 1),
                a + "dt_bias": grouped(w(b + "ssm_dt.bias"), 1),
                a + "A_log": grouped(torch.log(-w(b + "ssm_a")), 1),
                a + "norm.weight": w(b + "ssm_norm.weight"),
                a + "out_proj.weight": grouped(w(b + "ssm_out.weight").T, dv).T,  # value channels are columns
            }
    missing, unexpected = model.load_state_dict(sd, strict=True)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model


def glm4moe_reference(path: str) -> torch.nn.Module:
    """transformers' Glm4MoeForCausalLM with the file's weights, in float64, configured as llama.cpp reads the
    file: the trunk only (the NextN block's tensors are not loaded), q/k norms and attention biases where the
    file has them, the router's constants from its keys."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    with GGUFFile(path) as f:
        _, s = describe(f)
        e = s.extra
        tied = "output.weight" not in f.tensors
        qk_norm = "blk.0.attn_q_norm.weight" in f.tensors
        config = Glm4MoeConfig(
            **common_config(s, tied),
            intermediate_size=e["n_ff"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": s.rope_base,
                "partial_rotary_factor": s.rot_dim / s.head_dim,
            },
            attention_bias="blk.0.attn_q.bias" in f.tensors,
            use_qk_norm=qk_norm,
            n_routed_experts=s.n_expert,
            n_shared_experts=s.n_ff_shexp // s.n_ff_exp,
            first_k_dense_replace=s.n_layer_dense_lead,
            routed_scaling_factor=e["weights_scale"],
            norm_topk_prob=e["weights_norm"],
            n_group=e["n_group"],
            topk_group=e["group_used"],
            attn_implementation="eager",
            experts_implementation="eager",  # the per-expert loop: torch's grouped_mm takes no float64
        )
        model = Glm4MoeForCausalLM(config).double().eval()

        def w(name: str) -> torch.Tensor:
            return dequantized(f, name)

        sd = {
            "model.embed_tokens.weight": w("token_embd.weight"),
            "model.norm.weight": w("output_norm.weight"),
            "lm_head.weight": w("token_embd.weight" if tied else "output.weight"),
        }
        for il in range(s.n_layer):
            b, m = f"blk.{il}.", f"model.layers.{il}."
            sd |= {
                m + "input_layernorm.weight": w(b + "attn_norm.weight"),
                m + "post_attention_layernorm.weight": w(b + "post_attention_norm.weight"),
                m + "self_attn.o_proj.weight": w(b + "attn_output.weight"),
            }
            for x in "qkv":
                sd[m + f"self_attn.{x}_proj.weight"] = w(b + f"attn_{x}.weight")
                if config.attention_bias:
                    sd[m + f"self_attn.{x}_proj.bias"] = w(b + f"attn_{x}.bias")
            if qk_norm:
                sd[m + "self_attn.q_norm.weight"] = w(b + "attn_q_norm.weight")
                sd[m + "self_attn.k_norm.weight"] = w(b + "attn_k_norm.weight")
            if il < s.n_layer_dense_lead:
                sd |= {m + f"mlp.{x}_proj.weight": w(b + f"ffn_{x}.weight") for x in ("gate", "up", "down")}
                continue
            sd |= {
                m + "mlp.gate.weight": w(b + "ffn_gate_inp.weight"),
                m + "mlp.gate.e_score_correction_bias": w(b + "exp_probs_b.bias"),
                m + "mlp.experts.gate_up_proj": torch.cat(
                    [w(b + "ffn_gate_exps.weight"), w(b + "ffn_up_exps.weight")], dim=1
                ),
                m + "mlp.experts.down_proj": w(b + "ffn_down_exps.weight"),
            }
            for x in ("gate", "up", "down"):
                sd[m + f"mlp.shared_experts.{x}_proj.weight"] = w(b + f"ffn_{x}_shexp.weight")
    missing, unexpected = model.load_state_dict(sd, strict=True)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return model


def gpt_oss_reference(path: str) -> torch.nn.Module:
    """transformers' GptOssForCausalLM with the file's weights, in float64, configured as llama.cpp reads the
    file: YaRN with the correction range rounded (truncate, which gpt-oss's shipped config turns off), the
    file's window and sliding layers. transformers keeps gate and up interleaved in one [E, D, 2F] stack (gate
    the even columns), transposed from the GGUF's [E, F, D]; the biases likewise."""
    from transformers import GptOssConfig, GptOssForCausalLM

    with GGUFFile(path) as f:
        _, s = describe(f)
        e = s.extra
        yarn = e["yarn"]
        config = GptOssConfig(
            **common_config(s, tied=False),
            intermediate_size=s.n_ff_exp,
            sliding_window=e["sliding_window"],
            layer_types=["sliding_attention" if slides else "full_attention" for slides in e["sliding_layers"]],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": s.rope_base,
                "factor": yarn.factor,
                "beta_fast": yarn.beta_fast,
                "beta_slow": yarn.beta_slow,
                "original_max_position_embeddings": yarn.n_ctx_orig,
                "truncate": True,
            },
            attn_implementation="eager",
            experts_implementation="eager",  # its per-expert loop: the grouped form takes no float64
        )
        model = GptOssForCausalLM(config).double().eval()

        def w(name: str) -> torch.Tensor:
            return dequantized(f, name).double()

        def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return torch.stack([gate, up], dim=-1).flatten(-2)  # column 2j: gate j, 2j+1: up j

        sd = {
            "model.embed_tokens.weight": w("token_embd.weight"),
            "model.norm.weight": w("output_norm.weight"),
            "lm_head.weight": w("output.weight"),
        }
        for il in range(s.n_layer):
            b, m = f"blk.{il}.", f"model.layers.{il}."
            a = m + "self_attn."
            sd |= {
                m + "input_layernorm.weight": w(b + "attn_norm.weight"),
                m + "post_attention_layernorm.weight": w(b + "post_attention_norm.weight"),
                a + "sinks": w(b + "attn_sinks.weight"),
                m + "mlp.router.weight": w(b + "ffn_gate_inp.weight"),
                m + "mlp.router.bias": w(b + "ffn_gate_inp.bias"),
                m + "mlp.experts.gate_up_proj": interleaved(
                    w(b + "ffn_gate_exps.weight").transpose(1, 2), w(b + "ffn_up_exps.weight").transpose(1, 2)
                ),
                m + "mlp.experts.gate_up_proj_bias": interleaved(
                    w(b + "ffn_gate_exps.bias"), w(b + "ffn_up_exps.bias")
                ),
                m + "mlp.experts.down_proj": w(b + "ffn_down_exps.weight").transpose(1, 2),
                m + "mlp.experts.down_proj_bias": w(b + "ffn_down_exps.bias"),
            }
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
                sd |= {a + theirs + ".weight": w(b + ours + ".weight"), a + theirs + ".bias": w(b + ours + ".bias")}
            sd |= {a + "o_proj.weight": w(b + "attn_output.weight"), a + "o_proj.bias": w(b + "attn_output.bias")}
    missing, unexpected = model.load_state_dict(sd, strict=True)
    assert not unexpected and not missing, (missing, unexpected)
    return model


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the reference, recomputing the whole sequence each step (no cache to get wrong)."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(torch.argmax(logits)))
    return seq[len(prompt) :]


def assert_matches_reference(path: str, reference: torch.nn.Module, label: str, tol: float = 1e-4) -> None:
    """Logits of a 23-token prompt (micro-batches of 7) within tol of the reference, then 32 greedy tokens."""
    import moestream
    from moestream.runtime.sampling import SamplingParams

    engine = moestream.load(path, device="cpu", ubatch=7, progress=False)
    tokens = prompt_tokens(23, engine.spec.n_vocab)
    ours = engine.logits(tokens)
    with torch.inference_mode():
        theirs = reference(torch.tensor([tokens])).logits[0]
    err = rel_err(ours, theirs)
    print(f"{label}: max relative logit error vs transformers {err:.2e}")
    assert err < tol, f"{label}: logits differ from transformers by {err:.2e} (relative)"
    params = SamplingParams(max_tokens=32, temperature=0.0, stop_at_eos=False)
    assert engine.generate(tokens, params).tokens == greedy(reference, tokens, 32)
    engine.close()
