"""The pinned SGLang (0.5.14) and vLLM (0.25.1) DFlash drafter models, run from their released
source on CPU (tests/test_export_dflash.py), over helpers_engines' stand-ins for what needs GPUs.

Released code that runs: SGLang's `DFlashDraftModel` / `DFlashDecoderLayer` / `DFlashAttention`
/ `DFlashMLP` (__init__, load_weights, forward, project_target_hidden, kv_proj_only, apply_k_norm,
apply_k_rope), its `parse_dflash_draft_config` and `apply_qk_norm`, `get_rope_config`, RMSNorm
and SiluAndMul `forward_native`; vLLM's `EAGLEConfig` (the draft config it builds for method
dflash), `DFlashQwen3ForCausalLM` / `DFlashQwen3Model` / `DFlashQwen3DecoderLayer` /
`DFlashQwen3Attention` (__init__, load_weights, combine_hidden_states,
precompute_and_store_context_kv, forward, compute_logits), `Qwen2MLP`, `AutoWeightsLoader`,
`process_eagle_weight`, `set_default_rope_theta`, RMSNorm `forward_native`.

Stand-ins added here, from the engines' semantics at tensor-parallel size 1: attention that sees
the context keys/values stored for its layer plus the block's own, with no mask (both engines
draft a DFlash block non-causally: SGLang ENCODER_ONLY, vLLM `use_non_causal`); vLLM's
`ops.rms_norm` (out = x · rsqrt(mean x² + eps) · w, w per outer index when 2-D) and
`ops.rotary_embedding` (neox style from a [positions, cos | sin] cache, in place); and the two
engines' orchestration of one draft step (which methods they call in which order), cited where
it is written.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from helpers_engine_source import engine_source, load_defs, load_method
from helpers_engines import Loads, _forward_module, log, stand_ins


class ContextAttention(nn.Module):
    """Non-causal attention over this layer's stored context keys/values plus the new ones.
    q [T, heads*d], k/v [T, kv*d] -> [T, heads*d]; `store(k, v)` adds context rows."""

    def __init__(self, num_heads, head_dim, scaling, num_kv_heads=None, *args, **kwargs):
        super().__init__()
        self.heads, self.head_dim, self.scaling = num_heads, head_dim, scaling
        self.kv_heads = num_kv_heads or num_heads
        self.context: tuple | None = None
        self.kv_cache = None
        self.impl = SimpleNamespace(do_kv_cache_update=lambda attn, k, v, cache, slots: attn.store(k, v))

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = (t.reshape(t.shape[0], self.kv_heads, self.head_dim) for t in (k, v))
        if self.context is not None:
            k, v = torch.cat([self.context[0], k]), torch.cat([self.context[1], v])
        self.context = (k, v)

    def forward(self, q, k, v, *args, **kwargs):
        T, d = q.shape[0], self.head_dim
        k, v = (t.reshape(T, self.kv_heads, d) for t in (k, v))
        if self.context is not None:
            k, v = torch.cat([self.context[0], k]), torch.cat([self.context[1], v])
        rep = self.heads // self.kv_heads
        q = q.view(T, self.heads, d).transpose(0, 1)
        k, v = (t.transpose(0, 1).repeat_interleave(rep, 0) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling)
        return out.transpose(0, 1).reshape(T, self.heads * d)


class CachedNeoxRope(nn.Module):
    """Neox-style RoPE with vLLM's `cos_sin_cache` [max_position, rotary_dim] (cos | sin halves)."""

    def __init__(self, head_size: int, base: float, max_position: int):
        super().__init__()
        self.head_size, self.is_neox_style = head_size, True
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = self.cos_sin_cache[positions].to(x.dtype).chunk(2, dim=-1)
        x = x.view(T, -1, self.head_size)
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(T, -1)

    def forward(self, positions, q, k=None):
        return self.rotate(positions, q), None if k is None else self.rotate(positions, k)


def _rope_theta(params: dict | None, theta) -> float:
    return float((params or {}).get("rope_theta", theta))


# ---------------------------------------------------------------- SGLang


def sglang_dflash(version: str, folder: Path) -> tuple[nn.Module, Loads]:
    """SGLang `version`'s DFlashDraftModel for the exported folder (config via transformers)."""
    from transformers import AutoConfig

    src = engine_source("sglang", version)
    loads = Loads()
    prims = stand_ins(loads)
    norm = _forward_module(
        "RMSNorm",
        load_method(src / "sglang/srt/layers/layernorm.py", "RMSNorm", "forward_native", {"torch": torch}),
        {"variance_size_override": None, "override_orig_dtype": None, "fp32_residual": False,
         "cast_x_before_out_mul": False},
    )  # fmt: skip
    silu = _forward_module(
        "SiluAndMul", load_method(src / "sglang/srt/layers/activation.py", "SiluAndMul", "forward_native",
                                  {"torch": torch, "F": F}), {}  # fmt: skip
    )
    utils = load_defs(src / "sglang/srt/models/utils.py", ["_reshape_for_qk_norm", "apply_qk_norm"],
                      {"_is_cuda": False, "get_is_capture_mode": lambda: False})  # fmt: skip
    dflash_utils = load_defs(
        src / "sglang/srt/speculative/dflash_utils.py",
        ["DEFAULT_DFLASH_MASK_TOKEN", "build_target_layer_ids", "get_dflash_layer_types",
         "get_dflash_attention_sliding_window_size", "_cfg_get", "_get_text_config", "_get_dflash_config",
         "_parse_optional_int", "DFlashDraftConfig", "parse_dflash_draft_config", "can_dflash_slice_qkv_weight"],
        {"UnquantizedLinearMethod": type("UnquantizedLinearMethod", (), {})},
    )  # fmt: skip
    rope_config = load_defs(src / "sglang/srt/utils/hf_transformers/common.py", ["get_rope_config"], {})

    def get_rope(head_size, rotary_dim, max_position, base, rope_scaling=None, is_neox_style=True, **_):
        kind = (rope_scaling or {}).get("rope_type", "default")
        assert kind == "default" and is_neox_style and rotary_dim == head_size, (kind, is_neox_style)
        return CachedNeoxRope(head_size, base, max_position)

    parallel = SimpleNamespace(tp_size=1, tp_rank=0)
    env = {
        **prims, **{k: v for k, v in dflash_utils.items() if not k.startswith("__")},
        "RMSNorm": norm, "SiluAndMul": silu, "torch": torch, "nn": nn, "F": F,
        "apply_qk_norm": utils["apply_qk_norm"], "get_rope_config": rope_config["get_rope_config"],
        "get_rope": get_rope, "RadixAttention": ContextAttention, "get_parallel": lambda: parallel,
        "AttentionType": SimpleNamespace(ENCODER_ONLY="encoder_only", DECODER="decoder"),
        "LogitsProcessorOutput": lambda **kw: SimpleNamespace(**kw), "ForwardBatch": object,
        "_is_npu": False, "logger": log,
    }  # fmt: skip
    classes = load_defs(src / "sglang/srt/models/dflash.py",
                        ["_get_dflash_layer_attention_params", "DFlashAttention", "DFlashMLP", "DFlashDecoderLayer",
                         "DFlashDraftModel"], env)  # fmt: skip
    return classes["DFlashDraftModel"](AutoConfig.from_pretrained(str(folder))), loads


def sglang_load(model: nn.Module, loads: Loads, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Run load_weights one tensor at a time; returns the names it skipped (its loader ignores
    names that resolve to no parameter, silently)."""
    skipped = []
    for name, w in tensors.items():
        count = sum(map(len, loads.by_param.values()))
        model.load_weights([(name, w)])
        if sum(map(len, loads.by_param.values())) == count:
            skipped.append(name)
    return skipped


@torch.no_grad()
def sglang_draft(model, aux, ctx_positions, block_ids, block_positions, embed, lm_head) -> torch.Tensor:
    """One block as SGLang's DFLASH worker drafts it (speculative/dflash_worker_v2.py: the context
    rows go through project_target_hidden, then each layer's kv_proj_only -> apply_k_norm ->
    apply_k_rope into that layer's KV cache (lines 907-990); the block [verified token, masks]
    enters as the target's embeddings at its positions and the target's LM head reads the output).
    aux [N, K*H], ctx_positions [N], block_ids / block_positions [B] -> logits [B, V]."""
    ctx = model.project_target_hidden(aux)
    for layer in model.layers:
        attn = layer.self_attn
        k, v = attn.kv_proj_only(ctx)
        k = attn.apply_k_rope(ctx_positions, attn.apply_k_norm(k))
        attn.attn.context = None
        attn.attn.store(k, v)
    out = model(block_ids, block_positions, None, input_embeds=F.embedding(block_ids, embed))
    return out.hidden_states @ lm_head.T


# ---------------------------------------------------------------- vLLM


def vllm_dflash(version: str, folder: Path, target_layers: int, target_vocab: int) -> tuple[nn.Module, Loads]:
    """vLLM `version`'s DFlashQwen3ForCausalLM for the exported folder, its config built as vLLM
    builds a method-dflash draft config (config/speculative.py: AutoConfig, then EAGLEConfig)."""
    from transformers import AutoConfig

    src = engine_source("vllm", version)
    eagle = load_defs(src / "vllm/transformers_utils/configs/eagle.py", ["EAGLEConfig"],
                      {"without_trust_remote_code": lambda kw: kw})  # fmt: skip
    config = eagle["EAGLEConfig"](AutoConfig.from_pretrained(str(folder)), method="dflash", model_type="eagle")
    assert config.architectures == ["DFlashDraftModel"], config.architectures  # registry.py: qwen3_dflash

    loads = Loads()
    prims = stand_ins(loads)
    ops_ln = load_defs(src / "vllm/ir/ops/layernorm.py", ["rms_norm", "fused_add_rms_norm"], {},
                       strip_decorators=("register_op",))  # fmt: skip
    ir = SimpleNamespace(ops=SimpleNamespace(rms_norm=ops_ln["rms_norm"],
                                             fused_add_rms_norm=SimpleNamespace(maybe_inplace=ops_ln["fused_add_rms_norm"])))  # fmt: skip
    norm = _forward_module(
        "RMSNorm",
        load_method(src / "vllm/model_executor/layers/layernorm.py", "RMSNorm", "forward_native", {"ir": ir}),
        {"variance_size_override": None, "pass_weight": True, "pass_weight_add": True},
    )
    silu = _forward_module(
        "SiluAndMul", load_method(src / "vllm/model_executor/layers/activation.py", "SiluAndMul", "forward_native",
                                  {"torch": torch, "F": F}), {}  # fmt: skip
    )
    utils = load_defs(
        src / "vllm/model_executor/models/utils.py",
        ["WeightsMapper", "AutoWeightsLoader", "maybe_prefix", "extract_layer_index", "process_eagle_weight"],
        {**prims, "supports_any_eagle": lambda model: True,
         "support_quantized_model_reload_from_hp_weights": lambda load_weights: load_weights},  # fmt: skip
    )
    theta = load_defs(src / "vllm/transformers_utils/config.py", ["set_default_rope_theta"], {})

    def rms_norm(out, x, weight, eps):  # csrc layernorm: one weight row per outer index when 2-D
        w = weight if weight.dim() == 1 else weight.view(weight.shape[0], *[1] * (x.dim() - 2), weight.shape[-1])
        xf = x.float()
        out.copy_((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w.to(x.dtype))

    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
        assert key is None and is_neox
        rope = CachedNeoxRope.__new__(CachedNeoxRope)
        rope.head_size, rope.cos_sin_cache = head_size, cos_sin_cache
        query.copy_(CachedNeoxRope.rotate(rope, positions, query))

    def get_rope(head_size, max_position=None, is_neox_style=True, rope_parameters=None, **_):
        params = rope_parameters or {}
        assert params.get("rope_type", "default") == "default" and is_neox_style
        return CachedNeoxRope(head_size, _rope_theta(params, 10000), max_position or 4096)

    vllm_config = None  # set below; the model reads it through get_current_vllm_config()
    env = {
        **prims, **{k: utils[k] for k in ("AutoWeightsLoader", "maybe_prefix", "process_eagle_weight")},
        "RMSNorm": norm, "SiluAndMul": silu, "torch": torch, "nn": nn, "F": F, "io": __import__("io"),
        "ops": SimpleNamespace(rms_norm=rms_norm, rotary_embedding=rotary_embedding),
        "get_rope": get_rope, "Attention": ContextAttention,
        "AttentionType": SimpleNamespace(DECODER="decoder", ENCODER_ONLY="encoder_only"),
        "get_tensor_model_parallel_world_size": lambda: 1, "get_tensor_model_parallel_rank": lambda: 0,
        "get_current_vllm_config": lambda: vllm_config, "get_draft_quant_config": lambda config: None,
        "init_logger": lambda name: log, "logger": log, "support_torch_compile": lambda cls: cls,
        "set_default_rope_theta": theta["set_default_rope_theta"], "maybe_remap_kv_scale_name": lambda n, p: n,
        "get_hf_file_bytes": lambda *a, **kw: None, "Qwen3ForCausalLM": nn.Module,
        "VllmConfig": object, "CacheConfig": object, "NestedTensors": object, "Qwen3Config": object,
    }  # fmt: skip
    env["Qwen3MLP"] = load_defs(src / "vllm/model_executor/models/qwen2.py", ["Qwen2MLP"], dict(env))["Qwen2MLP"]
    classes = load_defs(src / "vllm/model_executor/models/qwen3_dflash.py",
                        ["_resolve_layer_attention", "DFlashQwen3Attention", "DFlashQwen3DecoderLayer",
                         "DFlashQwen3Model", "DFlashQwen3ForCausalLM"], env)  # fmt: skip
    model_config = SimpleNamespace(dtype=torch.float32, get_num_layers=lambda parallel: target_layers,
                                   get_vocab_size=lambda: target_vocab)  # fmt: skip
    vllm_config = SimpleNamespace(
        model_config=model_config, parallel_config=None, cache_config=None, quant_config=None,
        speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=config, model=str(folder),
                                                                              revision=None)),
    )  # fmt: skip
    return classes["DFlashQwen3ForCausalLM"](vllm_config=vllm_config, prefix=""), loads


@torch.no_grad()
def vllm_draft(model, aux, ctx_positions, block_ids, block_positions, embed, lm_head) -> torch.Tensor:
    """One block as vLLM's DFlashProposer drafts it (spec_decode/llm_base_proposer.py:
    combine_hidden_states on the target states; spec_decode/dflash.py: precompute_and_store_context_kv
    into the KV cache, then the model on [next token, masks] at their positions; the sampled rows'
    hidden states through compute_logits), with the target's embedding and LM head shared
    (_maybe_share_embeddings / _maybe_share_lm_head). Returns logits [B, V]."""
    model.model.embed_tokens.weight.data = embed.clone()
    model.lm_head.weight.data = lm_head.clone()
    for attn in model.model._attn_layers:
        attn.context = None
    context = model.combine_hidden_states(aux)
    model.precompute_and_store_context_kv(context, ctx_positions, torch.zeros_like(ctx_positions))
    hidden = model(block_ids, block_positions)
    return model.compute_logits(hidden)
