"""The pinned SGLang and vLLM EAGLE-3 drafter models, run from their released source on CPU.

The engines' own code runs for everything that decides whether an export serves: config
reading (vLLM's speculators-config conversion and RoPE patching; transformers' config for
SGLang), the model classes' `__init__` (which parameters exist, with which shapes, e.g. `fc`
sized from the aux count), `load_weights` (which checkpoint names map where, which are skipped)
and `forward` (how the layer stack passes hidden state and residual). Also their RMSNorm and
SiLU-and-mul reference (`forward_native`) code. What needs GPUs or their kernels is replaced by
small stand-ins written here, from those engines' semantics at tensor-parallel size 1:
column/row-parallel linears (a plain weight [out, in], stacked shards at their offsets), causal
attention with a KV cache, neox-style RoPE, embedding and LM-head weights.

Each stand-in weight loader records what it loaded, so a check sees every checkpoint tensor
that the engine skips and every parameter it leaves unloaded.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from helpers_engine_source import engine_source, load_defs, load_method

log = logging.getLogger("released-engines")


# ---------------------------------------------------------------- stand-ins


class Loads:
    """Which shards of which parameter the engine's loading wrote (by parameter identity)."""

    def __init__(self):
        self.by_param: dict[int, list] = defaultdict(list)

    def record(self, param: torch.Tensor, shard) -> None:
        assert shard not in self.by_param[id(param)], f"shard {shard!r} of a parameter loaded twice"
        self.by_param[id(param)].append(shard)


def _neox_rope(positions: torch.Tensor, x: torch.Tensor, head: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, n*head] rotated by neox-style (split-halves) RoPE at positions [T]."""
    T = x.shape[0]
    freqs = positions.float()[:, None] * inv_freq[None]  # [T, head/2], fp32 like the engines' caches
    cos, sin = freqs.cos().to(x.dtype)[:, None], freqs.sin().to(x.dtype)[:, None]
    x = x.view(T, -1, head)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(T, -1)


def stand_ins(loads: Loads) -> dict:
    """The engine primitives both model files use, recording loads into `loads`."""

    def default_weight_loader(param, loaded_weight, *shard):
        assert not shard, f"default_weight_loader got a shard id {shard}"
        assert (
            param.shape == loaded_weight.shape
        ), f"Attempted to load weight ({tuple(loaded_weight.shape)}) into parameter ({tuple(param.shape)})"
        param.data.copy_(loaded_weight)
        loads.record(param, None)

    class Linear(nn.Module):
        """weight [sum(out), in]; `shards`: shard id -> (row offset, rows) for stacked projections."""

        def __init__(self, in_features: int, shards: dict, bias: bool, return_bias: bool = True):
            super().__init__()
            out = sum(size for _, size in shards.values())
            self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
            self.weight.shards = set(shards) if len(shards) > 1 else {None}
            self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
            self.shards, self.return_bias = shards, return_bias

        def weight_loader(self, param, loaded_weight, shard_id=None):
            # vLLM's WeightsMapper tags a stacked checkpoint tensor with its shard id instead
            shard_id = shard_id if shard_id is not None else getattr(loaded_weight, "shard_id", None)
            if shard_id is None:
                return default_weight_loader(param, loaded_weight)
            offset, rows = self.shards[shard_id]
            target = param.data.narrow(0, offset, rows)
            assert (
                target.shape == loaded_weight.shape
            ), f"shard {shard_id!r}: weight {tuple(loaded_weight.shape)} into rows of shape {tuple(target.shape)}"
            target.copy_(loaded_weight)
            loads.record(param, shard_id)

        def forward(self, x, *args, **kwargs):  # tensor-parallel options (skip_all_reduce …) moot at TP 1
            y = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
            return (y, None) if self.return_bias else y

    def QKVParallelLinear(hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=True, **_):
        q, kv = total_num_heads * head_size, (total_num_kv_heads or total_num_heads) * head_size
        return Linear(hidden_size, {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}, bias)

    def MergedColumnParallelLinear(input_size, output_sizes, bias=True, **_):
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        return Linear(input_size, {i: (o, s) for i, (o, s) in enumerate(zip(offsets, output_sizes))}, bias)

    def RowParallelLinear(input_size, output_size, bias=True, **_):
        return Linear(input_size, {None: (0, output_size)}, bias)

    def ReplicatedLinear(input_size, output_size, bias=True, return_bias=True, **_):
        return Linear(input_size, {None: (0, output_size)}, bias, return_bias)

    class Embedding(nn.Module):
        def __init__(self, num_embeddings, embedding_dim, *args, **kwargs):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
            self.weight.shards = {None}

        def forward(self, ids):
            return F.embedding(ids, self.weight)

    class CachedAttention(nn.Module):
        """Causal attention over a KV cache: new queries see every cached entry and the new ones
        up to themselves. q [T, heads*d], k/v [T, kv_heads*d] -> [T, heads*d]."""

        def __init__(self, num_heads, head_dim, scaling, num_kv_heads=None, *args, **kwargs):
            super().__init__()
            self.heads, self.head_dim, self.scaling = num_heads, head_dim, scaling
            self.kv_heads = num_kv_heads or num_heads
            self.cache: tuple | None = None

        def forward(self, q, k, v, *args, **kwargs):
            T, d = q.shape[0], self.head_dim
            q = q.view(T, self.heads, d).transpose(0, 1)
            k, v = (t.view(T, self.kv_heads, d).transpose(0, 1) for t in (k, v))
            if self.cache is not None:
                k, v = torch.cat([self.cache[0], k], dim=1), torch.cat([self.cache[1], v], dim=1)
            self.cache = (k, v)
            L, rep = k.shape[1], self.heads // self.kv_heads
            mask = torch.ones(T, L, dtype=torch.bool).tril(L - T)
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), attn_mask=mask, scale=self.scaling
            )
            return out.transpose(0, 1).reshape(T, self.heads * d)

    class NeoxRope(nn.Module):
        def __init__(self, head_size: int, rotary_dim: int, base: float):
            super().__init__()
            assert rotary_dim == head_size, "partial rotary is not used by these drafters"
            self.head = head_size
            self.inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))

        def forward(self, positions, q, k):
            return _neox_rope(positions, q, self.head, self.inv_freq), _neox_rope(
                positions, k, self.head, self.inv_freq
            )

    class LogitsProcessor:
        """Draft logits: hidden [T, H] @ lm_head.weight.T."""

        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, lm_head, hidden, *args, **kwargs):
            return hidden @ lm_head.weight.T.to(hidden.dtype)

    class Missing:  # isinstance targets only
        pass

    return {
        "default_weight_loader": default_weight_loader, "QKVParallelLinear": QKVParallelLinear,
        "MergedColumnParallelLinear": MergedColumnParallelLinear, "RowParallelLinear": RowParallelLinear,
        "ReplicatedLinear": ReplicatedLinear, "VocabParallelEmbedding": Embedding, "ParallelLMHead": Embedding,
        "LogitsProcessor": LogitsProcessor, "CachedAttention": CachedAttention, "NeoxRope": NeoxRope,
        "QuantizationConfig": type("QuantizationConfig", (), {}), "logger": log,
        "PPMissingLayer": Missing, "StageMissingLayer": Missing,
    }  # fmt: skip


def _forward_module(name: str, forward, attrs: dict) -> type:
    """An nn.Module class whose forward is a released `forward_native` (method or staticmethod)."""
    is_method = next(iter(inspect.signature(forward).parameters)) == "self"

    def __init__(self, hidden_size=None, eps=1e-6, *args, **kwargs):
        nn.Module.__init__(self)
        if hidden_size is not None:  # a norm
            self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
            self.weight.shards = {None}
            self.hidden_size, self.variance_epsilon = hidden_size, eps
        for k, v in attrs.items():
            setattr(self, k, v)

    return type(name, (nn.Module,), {"__init__": __init__, "forward": forward if is_method else staticmethod(forward)})


def reset_caches(model: nn.Module) -> None:
    for m in model.modules():
        if hasattr(m, "cache"):
            m.cache = None


def unloaded(model: nn.Module, loads: Loads, shared: tuple[str, ...]) -> dict[str, object]:
    """Parameters (name -> shards still missing) that loading left unset; `shared` names are the
    ones the engine takes from the target model instead of the draft checkpoint."""
    missing = {}
    for name, p in model.named_parameters():
        got = set(loads.by_param.get(id(p), []))
        if name in shared:
            continue
        want = getattr(p, "shards", {None})
        if got != want and got != {None}:
            missing[name] = sorted(map(str, want - got))
    return missing


# ---------------------------------------------------------------- SGLang


@contextlib.contextmanager
def _no_context():
    yield


def _sglang_rope(prims):
    def get_rope(head_size, rotary_dim, max_position, base, rope_scaling=None, is_neox_style=True, *a, **kw):
        kind = (rope_scaling or {}).get("rope_type", "default")
        assert kind == "default" and is_neox_style, f"the oracle implements default neox RoPE, not {kind}"
        return prims["NeoxRope"](head_size, rotary_dim, base)

    return get_rope


def sglang_classes(version: str, loads: Loads) -> dict:
    """SGLang `version`'s llama_eagle3 classes (and the llama.py layers they build on) over the stand-ins."""
    src = engine_source("sglang", version)
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
    parallel = SimpleNamespace(tp_size=1, tp_rank=0, pp_group=SimpleNamespace(is_first_rank=True, is_last_rank=True))
    spec = SimpleNamespace(speculative_draft_window_size=None)
    common = {
        **prims, "RMSNorm": norm, "SiluAndMul": silu, "torch": torch, "nn": nn,
        "add_prefix": lambda name, prefix: f"{prefix}.{name}" if prefix else name,
        "get_parallel": lambda: parallel, "get_pp_group": lambda: parallel.pp_group,
        "get_tensor_model_parallel_world_size": lambda: 1, "get_global_server_args": lambda: spec,
        "get_spec": lambda: spec, "layer_stack": _no_context, "ForwardBatch": object, "PPProxyTensors": object,
        "RadixAttention": prims["CachedAttention"], "get_rope": _sglang_rope(prims),
        "_is_npu": False, "_is_cuda": False, "_is_xpu": False,
        "DraftParallelSpec": lambda **kw: SimpleNamespace(**kw), "DraftTPExecution": SimpleNamespace(SINGLE_GROUP=1),
        # 0.5.23's MLP: a fused dual GEMM and an fp8 decode path, neither runs on CPU / unquantized
        "DualGemm": lambda *a, **kw: SimpleNamespace(can_run=lambda *a: False),
        "DenseSiluAndMulQuant": lambda *a, **kw: None,
    }  # fmt: skip
    llama = load_defs(src / "sglang/srt/models/llama.py", ["LlamaMLP", "LlamaAttention", "LlamaDecoderLayer"],
                      dict(common))  # fmt: skip
    eagle = dict(common, LlamaDecoderLayer=llama["LlamaDecoderLayer"], LlamaMLP=llama["LlamaMLP"],
                 LlamaForCausalLM=nn.Module)  # fmt: skip
    return load_defs(src / "sglang/srt/models/llama_eagle3.py",
                     ["LlamaDecoderLayer", "LlamaModel", "LlamaForCausalLMEagle3"], eagle)  # fmt: skip


def sglang_config(folder: Path):
    """The draft config as SGLang reads it: transformers' AutoConfig over config.json."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def sglang_model(version: str, folder: Path) -> tuple[nn.Module, Loads]:
    loads = Loads()
    classes = sglang_classes(version, loads)
    return classes["LlamaForCausalLMEagle3"](sglang_config(folder)), loads


def sglang_load(model: nn.Module, loads: Loads, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Run SGLang's load_weights, one tensor at a time; returns the checkpoint names it skipped
    (neither loaded into a parameter nor taken as its hot-token map, as d2t is)."""
    skipped = []
    for name, w in tensors.items():
        count, model.hot_token_id = sum(map(len, loads.by_param.values())), None
        model.load_weights([(name, w)])
        if sum(map(len, loads.by_param.values())) == count and model.hot_token_id is None:
            skipped.append(name)
    hot = [w for name, w in tensors.items() if "d2t" in name]
    model.hot_token_id = hot[0] + torch.arange(hot[0].shape[0]) if hot else None  # as its loader sets it
    return skipped


def sglang_step(model, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor):
    """One draft forward as SGLang runs it: ids [T], positions [T], hidden [T, n_aux*H] (target
    states, fused by fc) or [T, H] (the drafter's own). Returns (draft logits [T, Vd], aux [T, H])."""
    mode = SimpleNamespace(is_extend=lambda: True, is_draft_extend_v2=lambda: False)
    batch = SimpleNamespace(spec_info=SimpleNamespace(hidden_states=hidden), forward_mode=mode,
                            contains_mm_inputs=lambda: False, mm_input_embeds=None)  # fmt: skip
    normed, (aux,) = model.model(ids, positions, batch)
    return model.logits_processor(model.lm_head, normed), aux


# ---------------------------------------------------------------- vLLM


def vllm_config(version: str, folder: Path):
    """The draft config as vLLM builds it from a speculators-format folder: its SpeculatorsConfig
    (speculators/base.py + algos.py) and then `patch_rope_parameters` (transformers_utils/config.py)."""
    src = engine_source("vllm", version)
    algos = load_defs(src / "vllm/transformers_utils/configs/speculators/algos.py",
                      ["SUPPORTED_SPECULATORS_TYPES", "register_speculator", "update_eagle3"], {})  # fmt: skip
    env = {"SUPPORTED_SPECULATORS_TYPES": algos["SUPPORTED_SPECULATORS_TYPES"],
           "without_trust_remote_code": lambda kw: {k: v for k, v in kw.items() if k != "trust_remote_code"}}  # fmt: skip
    base = load_defs(src / "vllm/transformers_utils/configs/speculators/base.py", ["SpeculatorsConfig"], env)
    utils = load_defs(src / "vllm/config/utils.py", ["getattr_iter"], {"logger": log})
    rope = load_defs(src / "vllm/transformers_utils/config.py",
                     ["is_rope_parameters_nested", "patch_legacy_rope_type", "patch_rope_parameters"],
                     {"getattr_iter": utils["getattr_iter"], "logger": log})  # fmt: skip
    config = base["SpeculatorsConfig"].from_pretrained(str(folder))
    rope["patch_rope_parameters"](config)
    return config


def _vllm_rope(prims):
    def get_rope(head_size, max_position=None, is_neox_style=True, rope_parameters=None, *a, **kw):
        params = rope_parameters or {}
        kind = params.get("rope_type", "default")
        assert kind == "default" and is_neox_style, f"the oracle implements default neox RoPE, not {kind}"
        assert "rope_dim" not in params and params.get("partial_rotary_factor", 1.0) == 1.0
        return prims["NeoxRope"](head_size, head_size, params.get("rope_theta", 10000))  # vLLM's get_rope default

    return get_rope


def vllm_classes(version: str, loads: Loads, vllm_config) -> dict:
    src = engine_source("vllm", version)
    prims = stand_ins(loads)
    ops = load_defs(src / "vllm/ir/ops/layernorm.py", ["rms_norm", "fused_add_rms_norm"], {},
                    strip_decorators=("register_op",))  # fmt: skip
    ir = SimpleNamespace(ops=SimpleNamespace(rms_norm=ops["rms_norm"],
                                             fused_add_rms_norm=SimpleNamespace(maybe_inplace=ops["fused_add_rms_norm"])))  # fmt: skip
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
        optional=("_get_tied_embedding_params",),  # 0.33
    )
    common = {
        **prims, **{k: utils[k] for k in ("WeightsMapper", "AutoWeightsLoader", "maybe_prefix", "extract_layer_index",
                                          "process_eagle_weight")},
        "RMSNorm": norm, "SiluAndMul": silu, "get_rope": _vllm_rope(prims), "Attention": prims["CachedAttention"],
        "EncoderOnlyAttention": prims["CachedAttention"],
        "AttentionType": SimpleNamespace(DECODER="decoder", ENCODER_ONLY="encoder_only"),
        "get_tensor_model_parallel_world_size": lambda: 1, "get_current_vllm_config": lambda: vllm_config,
        "get_draft_quant_config": lambda config: None, "init_logger": lambda name: log,
        "support_torch_compile": lambda *a, **kw: (lambda cls: cls),
        "VllmConfig": object, "CacheConfig": object, "NestedTensors": object,
        # 0.33's MLP: fuses the activation with the down projection's input quantization, if any;
        # unquantized (layers/fusion/fused_act_quant.py) it is act_fn(x)
        "maybe_fused_act_quant": lambda act_fn, x, linear: act_fn(x),
    }  # fmt: skip
    llama = load_defs(src / "vllm/model_executor/models/llama.py", ["LlamaMLP", "LlamaAttention", "LlamaDecoderLayer"],
                      dict(common))  # fmt: skip
    eagle = dict(common, LlamaDecoderLayer=llama["LlamaDecoderLayer"], BaseLlamaDecoderLayer=llama["LlamaDecoderLayer"],
                 LlamaAttention=llama["LlamaAttention"], LlamaMLP=llama["LlamaMLP"], LlamaForCausalLM=nn.Module)  # fmt: skip
    return load_defs(src / "vllm/model_executor/models/llama_eagle3.py",
                     ["LlamaDecoderLayer", "LlamaModel", "Eagle3LlamaForCausalLM"], eagle, type_checking=True)  # fmt: skip


def vllm_model(version: str, folder: Path, target_layers: int, target_vocab: int) -> tuple[nn.Module, Loads]:
    """vLLM `version`'s Eagle3LlamaForCausalLM for the speculators folder, built as its draft model."""
    config = vllm_config(version, folder)
    assert config.architectures == ["Eagle3LlamaForCausalLM"], config.architectures
    model_config = SimpleNamespace(
        hf_config=config, dtype=torch.float32, get_num_layers=lambda parallel: target_layers,
        get_total_num_hidden_layers=lambda: target_layers, get_vocab_size=lambda: target_vocab,
    )  # fmt: skip
    vllm_config_ = SimpleNamespace(
        model_config=model_config, parallel_config=None, cache_config=None, quant_config=None,
        speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=config), parallel_drafting=False),
    )  # fmt: skip
    loads = Loads()
    classes = vllm_classes(version, loads, vllm_config_)
    return classes["Eagle3LlamaForCausalLM"](vllm_config=vllm_config_, prefix=""), loads


def vllm_step(model, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, fuse: bool):
    """One draft forward as vLLM's proposer runs it (combine_hidden_states on target states, then
    the model). Returns (logits [T, V] over the target vocabulary, -inf off the draft vocab, aux [T, H])."""
    if fuse:
        hidden = model.combine_hidden_states(hidden)
    normed, aux = model(ids, positions, hidden)
    return model.compute_logits(normed), aux
