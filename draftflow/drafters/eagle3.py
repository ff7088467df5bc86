"""The EAGLE-3 drafter (DESIGN.md §3): Llama-style decoder layers over fused target states.

Parameter names follow SGLang's `LlamaForCausalLMEagle3` checkpoint layout
(sgl-project/sglang, python/sglang/srt/models/llama_eagle3.py), so a saved state dict
loads there as it is:

    fc.weight                                   [H, n_aux*H]  fuses the aux states, no bias
    midlayer.input_layernorm.weight             [H]       norm of the token embedding
    midlayer.hidden_norm.weight                 [H]       norm of the (fused or own) hidden state
    midlayer.self_attn.{q,k,v}_proj.weight      [*, 2H]   read cat(embed_norm, hidden_norm), that order
    midlayer.self_attn.o_proj.weight            [H, heads*head_dim]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up,down}_proj.weight
    layers.{i}.hidden_norm.weight, layers.{i}.self_attn.*, layers.{i}.post_attention_layernorm.weight,
    layers.{i}.mlp.*                            layers i = 1 .. num_hidden_layers-1, H-wide q/k/v
    norm.weight, lm_head.weight [Vd, H], d2t [Vd] int64, t2d [V] bool

The token embedding `embed_tokens` is the target's, frozen, and never exported. SGLang maps
`midlayer` to `layers.0`, so layer i is its `model.layers.{i}`.

Residual stream, as the pinned SGLang (0.5.14, 0.5.23) computes it, and vLLM's Eagle3 Llama
(whose layers i >= 1 call the pre-attention norm `input_layernorm`); h is the input hidden state:
    layer 0:   r = h + attn(cat(in_norm(embed), hidden_norm(h)));  x = mlp(post_norm(r))
    layer i:   s = x + r;  r = s + attn(hidden_norm(s));            x = mlp(post_norm(r))
    out = x + r  (before the final norm);  logits = lm_head(norm(out)).
The residual carries on through every layer; `out` is the hidden state fed back for the next
draft token. (draftflow format 1 restarted the residual at each extra layer, after an older
SGLang; such multi-layer drafters are refused on load: retrain them.)
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
# 2: extra layers are `layers.{i}` and carry the residual (1: `additional_layers.*`, restarted)
FORMAT_VERSION = 2
SUPPORTED_ROPE = ("default", "linear", "llama3")
VARIANT_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")


# ---------------------------------------------------------------- config


def _rope_of(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from an HF config, old (rope_theta/rope_scaling) or
    transformers-5 (rope_parameters) style."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = cfg.get("rope_scaling") or params or None
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in SUPPORTED_ROPE:
        # The drafter has its own RoPE; it need not match the target's, only training and serving
        # must agree. config.json records what we used, so servers apply the same.
        log.warning("target rope type %r is not supported for the drafter; using plain RoPE", kind)
        return theta, None
    return theta, dict(scaling, rope_type=kind)


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (rows of the frozen embedding)
    draft_vocab_size: int
    aux_layer_ids: list[int]  # decoder-layer outputs, 0-based (DESIGN.md §3), in fc input order
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    ttt_steps: int = 7
    # speculators' EAGLE-3 variants (its config names; all off = SGLang's LlamaForCausalLMEagle3):
    norm_before_fc: bool = False  # RMSNorm over cat(aux) [n_aux*H] before fc (`input_norm.weight`)
    norm_before_residual: bool = False  # first layer's residual is hidden_norm(h), not h
    norm_output: bool = False  # feed back norm(out) (what the LM head reads) instead of out
    target: str = ""  # target identity (draftflow.target.target_identity)
    target_path: str = ""  # where the target (and so the embedding) was read from
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        *,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        num_hidden_layers: int = 1,
        ttt_steps: int = 7,
        target: str = "",
        target_path: str = "",
    ) -> "Eagle3Config":
        cfg = target_config
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]  # multimodal wrappers keep the LM's config here
        H, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = _rope_of(cfg)
        return cls(
            hidden_size=H,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or H // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            num_hidden_layers=int(num_hidden_layers),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            ttt_steps=int(ttt_steps),
            target=target,
            target_path=target_path,
        )

    def to_dict(self) -> dict:
        """config.json: an HF LlamaConfig-style dict that SGLang reads, plus draftflow's record."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": "bfloat16",
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            "draftflow": {
                "format_version": FORMAT_VERSION,
                "aux_layer_ids": list(self.aux_layer_ids),
                "aux_layer_id_convention": "output of decoder layer i, counted from 0",
                "ttt_steps": self.ttt_steps,
                "target": self.target,
                "target_path": self.target_path,
                **self.extra,
            },
            # written only when on, so a plain drafter's config.json stays SGLang's
            **{k: True for k in VARIANT_FLAGS if getattr(self, k)},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        ours = dict(d.get("draftflow") or {})
        if ours.get("format_version") == 1 and d.get("num_hidden_layers", 1) > 1:
            raise ValueError(
                f"a {d['num_hidden_layers']}-layer drafter of draftflow format 1, whose extra layers "
                "(additional_layers.*) restart the residual stream; SGLang 0.5.14 / 0.5.23 and vLLM carry it "
                "on and skip those names, so it cannot be served: retrain it with this draftflow"
            )
        aux = ours.pop("aux_layer_ids", None) or (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            raise ValueError("config has no aux layer ids (draftflow.aux_layer_ids or eagle_config)")
        theta, scaling = _rope_of(d)
        known = {"format_version", "aux_layer_id_convention", "ttt_steps", "target", "target_path"}
        return cls(
            hidden_size=d["hidden_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            aux_layer_ids=list(aux),
            num_hidden_layers=d.get("num_hidden_layers", 1),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            ttt_steps=ours.get("ttt_steps", 7),
            **{k: bool(d.get(k, False)) for k in VARIANT_FLAGS},
            target=ours.get("target", ""),
            target_path=ours.get("target_path", ""),
            extra={k: v for k, v in ours.items() if k not in known},
        )

    def as_record(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)  # fp32 math, input dtype out (bf16 under autocast)


def rope_inv_freq(cfg: Eagle3Config) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies, with linear or llama3 scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.float()
    if s["rope_type"] == "linear":
        return (inv_freq / s["factor"]).float()
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0, 1)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return scaled.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids [B, S] -> cos, sin [B, 1, S, head_dim] fp32
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [B, S, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # in x's dtype, as HF Llama
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, in_features: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(self, x, cos, sin, expand: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, in] -> q [B, h, S, d], k, v [B, h, S, d] (expand) or [B, kv, S, d]: projected,
        RoPE on q and k. One region for `compile_pointwise`: RoPE and the expansion become one pass each way."""
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)  # [B, h, S, d]
        k = self.k_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, S, d]
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if expand and self.kv_heads != self.heads:  # expand GQA heads: keeps SDPA on its fused masked kernels
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        return q, k, v

    def forward(self, x, cos, sin, cache: "AttentionCache", layer: int) -> torch.Tensor:
        B, S, _ = x.shape  # x [B, S, in]
        q, k, v = self.project(x, cos, sin, expand=not cache.grouped_kv)
        out = cache.attend(layer, q, k, v)  # [B, h, S, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The EAGLE-3 layer: attention reads cat(input_layernorm(embed), hidden_norm(h)) [.., 2H]."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def attention_input(self, embeds, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x [B, S, 2H], hidden_norm(hidden) [B, S, H]); compiled, the norms write x in one pass."""
        normed = self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), normed

    def forward(self, embeds, hidden, cos, sin, cache, layer: int):
        x, normed = self.attention_input(embeds, hidden)
        residual = (normed if self.norm_before_residual else hidden) + self.self_attn(x, cos, sin, cache, layer)
        return self.mlp(self.post_attention_layernorm(residual)), residual


class FrozenEmbedding(nn.Module):
    """The target's token embedding: a non-persistent buffer, so it is neither trained, nor
    sharded or synchronized by DDP/FSDP, nor saved (SGLang shares the target's)."""

    def __init__(self, num: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num, dim, dtype=torch.bfloat16), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ExtraLayer(nn.Module):
    """Layers 1.. as SGLang's `LlamaDecoderLayer` with layer_id > 0: H-wide attention input, and the
    residual stream carried on from the previous layer (its MLP output is added to it first)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, cache, layer: int):
        stream = x + residual  # SGLang: hidden_norm(x, residual), a fused add + norm
        residual = stream + self.self_attn(self.hidden_norm(stream), cos, sin, cache, layer)
        return self.mlp(self.post_attention_layernorm(residual)), residual


# ---------------------------------------------------------------- attention caches


class AttentionCache:
    """Where a layer's keys/values go and which of them each query sees."""

    grouped_kv = False  # True: attend() takes keys/values with the kv heads (GQA), not expanded

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class KVCache(AttentionCache):
    """Inference cache: new queries see every cached entry plus the new ones up to themselves.

    Entries are in call order (the caller passes positions explicitly); after verification,
    `crop(n)` drops rejected draft entries.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers  # [B, h, L, d] each
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def attend(self, layer, q, k, v):
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        S, L = q.shape[2], k.shape[2]
        mask = None
        if S > 1:  # causal among the new queries, everything before them visible
            mask = torch.ones(S, L, dtype=torch.bool, device=q.device).tril(L - S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def crop(self, length: int) -> None:
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i], self.v[i] = self.k[i][:, :, :length], self.v[i][:, :, :length]


def ttt_chunk_mask(start: int, end: int, steps: int, device) -> torch.Tensor:
    """[c, end + (steps-1)*c] bool (c = end - start), for query rows start..end-1 over the keys
    cat(step-0 rows 0..end-1, then each later step's rows start..end-1): row j sees step-0
    keys 0..j and its own key of every later step."""
    c = end - start
    causal = torch.ones(c, end, dtype=torch.bool, device=device).tril(start)
    eye = torch.eye(c, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (steps - 1), dim=1)


class TTTCache(AttentionCache):
    """Training-time-test cache: step k's query at row j sees the step-0 keys of rows 0..j
    (target-derived states: the prefix and the chain's anchor) and row j's own keys from
    steps 1..k (the drafts of its chain) — exactly the drafter's KV cache at inference.

    Queries go in chunks of `chunk` rows: a chunk needs the step-0 keys up to its end and
    only its own rows of the later steps, so the masked attention costs ~T²/2 + k·chunk·T
    instead of (k+1)·T² (most of each later step's key block is masked out).

    doc [B, T] (packed rows, `packing`): the step-0 keys a query sees are also only its own
    sample's; padding (-1) sees padding, so no query row is empty.
    grouped_kv: keys and values come with the kv heads (GQA) and SDPA groups the queries itself
    (`enable_gqa`); the chunks' keys are then cat at the kv heads' width.
    """

    def __init__(self, num_layers: int, chunk: int = 256, doc: torch.Tensor | None = None, grouped_kv: bool = False):
        self.grouped_kv = grouped_kv  # kv heads as they come (SDPA's enable_gqa): 4x fewer key bytes to cat for GQA
        self.k: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(num_layers)]  # per layer, per step: pieces
        self.v: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(num_layers)]
        self.chunk = chunk
        self.doc = doc
        self._masks: dict[tuple, torch.Tensor] = {}

    def _mask(self, start: int, end: int, n: int, device, dtype: torch.dtype) -> torch.Tensor:
        """Additive bias (0 where seen, -inf where not) [c, end + (n-1)c], or [B, 1, c, end + (n-1)c]
        with docs (n = 1: step 0's own causal mask). Made once per shape in the queries' dtype:
        SDPA converts a boolean mask to this on every call, in two more kernels each way."""
        key = (start, end, n, device, dtype)
        if key not in self._masks:
            mask = ttt_chunk_mask(start, end, n, device)
            if self.doc is not None:
                doc = self.doc.to(device)
                same = doc[:, start:end, None] == doc[:, None, :end]  # [B, c, end]
                mask = mask.expand(doc.shape[0], *mask.shape).clone()
                mask[:, :, :end] &= same
                mask = mask[:, None]
            bias = torch.zeros(mask.shape, dtype=dtype, device=device)
            self._masks[key] = bias.masked_fill_(~mask, float("-inf"))
        return self._masks[key]

    def attend(self, layer, q, k, v):
        ks, vs = self.k[layer], self.v[layer]
        # Every step's keys and values are kept as pieces of `chunk` rows, and a chunk's keys are a
        # cat of whole pieces. Slicing the full tensors instead made every (chunk, step) backward a
        # full-size zero tensor plus an add: most of the step's memory traffic on the GPU.
        ks.append(k.split(self.chunk, dim=2))  # each piece [B, h, <=chunk, d]
        vs.append(v.split(self.chunk, dim=2))
        n, T = len(ks), q.shape[2]
        gqa = q.shape[1] != k.shape[1]
        if n == 1:
            if self.doc is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            mask = self._mask(0, T, 1, q.device, q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        outs = []
        for c, (start, q_chunk) in enumerate(zip(range(0, T, self.chunk), q.split(self.chunk, dim=2))):
            end = min(T, start + self.chunk)
            K = torch.cat([*ks[0][: c + 1], *(ki[c] for ki in ks[1:])], dim=2)  # step-0 rows :end, then row-aligned drafts
            V = torch.cat([*vs[0][: c + 1], *(vi[c] for vi in vs[1:])], dim=2)
            mask = self._mask(start, end, n, q.device, q.dtype)
            outs.append(F.scaled_dot_product_attention(q_chunk, K, V, attn_mask=mask, enable_gqa=gqa))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)  # static first; a new length recompiles with dynamic sizes


def ttt_mask_mod(rows: int, doc: torch.Tensor | None):
    """FlexAttention's mask over the keys of steps 0..n-1 laid end to end (n * rows keys): query
    row j sees step-0 keys 0..j and key j of every later step; with `doc` [B, rows] only keys of
    its own sample (as `TTTCache`)."""

    def seen(b, h, q_idx, kv_idx):
        step = kv_idx // rows
        row = kv_idx - step * rows
        visible = torch.where(step == 0, row <= q_idx, row == q_idx)
        return visible if doc is None else visible & (doc[b, row] == doc[b, q_idx])

    return seen


class FlexTTTCache(AttentionCache):
    """`TTTCache`'s attention as one FlexAttention call a step (`ttt.unroll(attention="flex")`; GPU
    training only: FlexAttention has no CPU backward). The keys of every step so far are laid end
    to end, with the kv heads (GQA) as they come, and a block mask skips the blocks no query sees
    (most of each later step's keys). Against the chunked SDPA path it copies ~6x fewer key bytes
    a step (no per-chunk prefixes, no expanded heads) and accumulates no per-piece gradients;
    whether its kernels beat cuDNN's is for the GPU to say (bench/train_throughput.py --ttt-attention)."""

    grouped_kv = True

    def __init__(self, num_layers: int, doc: torch.Tensor | None = None):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # per layer, per step: [B, kv, T, d]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.doc = doc
        self._masks: dict[tuple, BlockMask] = {}

    def _block_mask(self, n: int, rows: int, device) -> BlockMask:
        key = (n, rows, device)
        if key not in self._masks:
            doc = None if self.doc is None else self.doc.to(device)
            batch = None if doc is None else doc.shape[0]
            # compiled on the GPU: eager creation materializes [B, rows, n * rows] index tensors
            self._masks[key] = create_block_mask(ttt_mask_mod(rows, doc), batch, None, rows, n * rows, device=device,
                                                 _compile=device.type == "cuda")  # fmt: skip
        return self._masks[key]

    def attend(self, layer, q, k, v):
        ks, vs = self.k[layer], self.v[layer]
        ks.append(k)
        vs.append(v)
        K = k if len(ks) == 1 else torch.cat(ks, dim=2)  # [B, kv, n*T, d]
        V = v if len(vs) == 1 else torch.cat(vs, dim=2)
        mask = self._block_mask(len(ks), q.shape[2], q.device)
        attend = _compiled_flex_attention() if q.is_cuda else flex_attention  # eager: CPU forward only
        return attend(q, K, V, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# ---------------------------------------------------------------- the model


def init_linears_and_norms(model: nn.Module, std: float = 0.02) -> None:
    """A drafter's initialization: linear weights ~ N(0, std), norm weights 1."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter.

    Inference (chain speculative decoding), with `cache = KVCache(drafter.num_layers)`:

    1. after the target verified tokens x_0..x_n and chose the next token x_{n+1}, feed the
       rows whose cache entries are missing: `h = drafter.fuse(aux)` with aux [B, S, 3, H]
       the target's aux states at positions p..n, tokens x_{p+1}..x_{n+1} (each row pairs the
       target state at position i with the token that follows it), positions p..n:
       `logits, out, cache = drafter.step(tokens, h, positions, cache)`.
       `logits[:, -1]` gives the first draft token (draft ids; map with `to_target_ids`).
    2. each further draft token d at position q = n+1, n+2, …: `step(d, out[:, -1:], [q])`,
       feeding back the drafter's own pre-norm output hidden state.
    3. after verification accepts m drafts, `cache.crop(n + 1 + m)` … and continue with 1 for
       the newly verified rows (SGLang's "draft extend").
    """

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = FrozenEmbedding(cfg.vocab_size, H)  # set it from the target before use
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * H, H, bias=False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(len(cfg.aux_layer_ids) * H, cfg.rms_norm_eps)
        self.midlayer = MidLayer(cfg)
        # keyed "1", "2", …: state-dict names `layers.{i}.*` are SGLang's `model.layers.{i}.*`
        self.layers = nn.ModuleDict({str(i): ExtraLayer(cfg) for i in range(1, cfg.num_hidden_layers)})
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def reset_parameters(self, std: float = 0.02) -> None:
        init_linears_and_norms(self, std)

    def compile_pointwise(self) -> None:
        """Compile the norms, MLPs, attention projections and the first layer's input in place
        (torch.compile, dynamic shapes): inductor fuses the elementwise chains that eager runs as
        separate passes over [tokens, H]-sized tensors (fp32 norm math, SiLU x up, RoPE's neg/cat/
        mul/add, the GQA expansion, the norms' cat). Parameter names are unchanged."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, MLP)):
                m.compile(dynamic=True)
            elif isinstance(m, Attention):
                m.project = torch.compile(m.project, dynamic=True)
            elif isinstance(m, MidLayer):
                m.attention_input = torch.compile(m.attention_input, dynamic=True)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(torch.as_tensor(d2t))
        self.t2d.copy_(torch.as_tensor(t2d))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, S, n_aux, H] or [B, S, n_aux*H] (layer order of `aux_layer_ids`) -> [B, S, H]."""
        if aux.dim() == 4:
            aux = aux.flatten(-2)
        if not torch.is_autocast_enabled(aux.device.type):
            aux = aux.to(self.fc.weight.dtype)  # e.g. bf16 stored states into an fp32 CPU model
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: AttentionCache,
        only_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, S], hidden [B, S, H], position_ids [B, S] -> (logits [B, S, Vd], out [B, S, H]).

        only_at [B]: one position per row whose logits and out are wanted -> [B, 1, Vd], [B, 1, H].
        Drafting needs only each row's last fed position, and the head over a whole batch of prompts
        is B * S * Vd floats (80 prompts of 1,000 tokens at Vd 32,000: 10 GB)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(position_ids)
        x, residual = self.midlayer(embeds, hidden, cos, sin, cache, 0)
        for i, layer in self.layers.items():
            x, residual = layer(x, residual, cos, sin, cache, int(i))
        out = x + residual  # pre-norm: fed back as the next draft step's hidden state
        if only_at is not None:
            out = out[torch.arange(out.shape[0], device=out.device), only_at][:, None]  # [B, 1, H]
        normed = self.norm(out)
        return self.lm_head(normed), (normed if self.config.norm_output else out)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        only_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """One inference call (see the class docstring).

        input_ids [B, S] target ids; hidden [B, S, H]: `fuse(aux)` for target-derived rows, or
        the previous call's `out` for drafted rows; position_ids [B, S]; only_at [B]: see
        `forward_hidden` (every row still enters the cache).
        Returns (draft logits [B, S, Vd], out hidden [B, S, H], cache); [B, 1, …] with only_at.
        """
        cache = KVCache(self.num_layers) if cache is None else cache
        logits, out = self.forward_hidden(input_ids, hidden, position_ids, cache, only_at)
        return logits, out, cache

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The SGLang checkpoint tensors (the state dict: the embedding is not part of it)."""
        return dict(self.state_dict())
