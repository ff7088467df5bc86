"""The DFlash drafter (block diffusion drafting, arXiv 2602.06036): a few Qwen3-style decoder
layers that draft a whole block of tokens in one forward pass, conditioned on the target's
hidden states through their keys and values.

Parameter names are the checkpoint layout that SGLang 0.5.14's `DFlashDraftModel`
(python/sglang/srt/models/dflash.py) and vLLM 0.25.1's `DFlashQwen3ForCausalLM`
(vllm/model_executor/models/qwen3_dflash.py) load, as the reference checkpoints have it:

    fc.weight                                    [H, n*H]   fuses the n target layers' states
    hidden_norm.weight                           [H]        norm of the fused context state
    layers.{i}.input_layernorm.weight            [H]
    layers.{i}.self_attn.{q,k,v}_proj.weight     [*, H]
    layers.{i}.self_attn.o_proj.weight           [H, heads*head_dim]
    layers.{i}.self_attn.{q,k}_norm.weight       [head_dim]  per-head RMSNorm (Qwen3)
    layers.{i}.post_attention_layernorm.weight   [H]
    layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                                  [H]

The token embedding and the LM head are the target's, frozen and never saved: both engines
use the target's own (full vocabulary; no draft vocabulary).

Computation. The context state of position t is c_t = hidden_norm(fc(cat of the target's
states at t over `target_layer_ids`)), for every position the target has verified. A block
anchored at position a holds the last verified token x_a followed by block_size - 1 mask
tokens, at positions a .. a+B-1; its input is the target's embedding of those ids. In each
layer the block's queries attend to
  * the context rows t < a: keys k_norm(k_proj(c_t)) with RoPE at t, values v_proj(c_t)
    (no input_layernorm: the context is already normed), and
  * every row of the block, in both directions (no causal mask inside the block),
followed by the usual pre-norm residual and MLP. logits = lm_head(norm(out)); block row k
(1 .. B-1) drafts token x_{a+k}. Target layer ids follow DESIGN.md §3 (output of decoder
layer i, counted from 0), which is also the convention of DFlash configs: both engines
capture the input of layer i + 1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.drafters.eagle3 import MLP, RMSNorm, RotaryEmbedding, _rope_of, apply_rope, init_linears_and_norms
from draftflow.errors import DraftflowError

# train.dflash.labels and loss_weighting (their meaning: dflash_loss)
LABELS = ("target", "data", "soft")
WEIGHTINGS = ("decay", "dpace")

ARCHITECTURE = "DFlashDraftModel"
DEFAULT_MASK_TOKEN = "<|MASK|>"  # what SGLang adds to the tokenizer when a config names no id


# ---------------------------------------------------------------- config


def spread_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's own default layout (reference code and SGLang's `build_target_layer_ids`):
    one layer per draft layer, evenly spaced from layer 1 to layer N - 3 (one layer: N // 2).
    Qwen3-8B (36 layers) with 5 draft layers: [1, 9, 17, 25, 33]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise DraftflowError(f"DFlash's layer spread needs a target of >= 4 layers, got {num_target_layers}")
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's: rows of its embedding and LM head
    num_hidden_layers: int  # draft layers
    target_layer_ids: list[int]  # decoder-layer outputs, 0-based (DESIGN.md §3), in fc input order
    num_target_layers: int
    block_size: int = 16
    mask_token_id: int = 0
    mask_token: str | None = None  # the tokenizer's string for mask_token_id, when it has one
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    target: str = ""
    target_path: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        *,
        num_hidden_layers: int,
        target_layer_ids: Sequence[int],
        block_size: int,
        mask_token_id: int,
        mask_token: str | None = None,
        target: str = "",
        target_path: str = "",
    ) -> "DFlashConfig":
        """Layer shapes as the target's (what SpecForge derives a DFlash config from)."""
        cfg = target_config
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]
        H, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = _rope_of(cfg)
        return cls(
            hidden_size=H,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or H // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            num_hidden_layers=int(num_hidden_layers),
            target_layer_ids=[int(i) for i in target_layer_ids],
            num_target_layers=int(cfg["num_hidden_layers"]),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            mask_token=mask_token,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            target=target,
            target_path=target_path,
        )

    def to_dict(self) -> dict:
        """config.json: the Qwen3Config-style dict with `dflash_config` that SGLang and vLLM read
        (both take the architecture from `architectures`), plus draftflow's record."""
        dflash = {"block_size": self.block_size, "target_layer_ids": list(self.target_layer_ids),
                  "mask_token_id": self.mask_token_id}  # fmt: skip
        if self.mask_token:
            dflash["mask_token"] = self.mask_token
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            "draftflow": {
                "format_version": 1,
                "method": "dflash",
                "target_layer_ids": list(self.target_layer_ids),
                "aux_layer_id_convention": "output of decoder layer i, counted from 0",
                "target": self.target,
                "target_path": self.target_path,
                **self.extra,
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        ours = dict(d.get("draftflow") or {})
        dflash = d.get("dflash_config") or {}
        ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is None:
            raise ValueError("config has no dflash_config.target_layer_ids")
        if dflash.get("mask_token_id") is None:
            raise ValueError("config has no dflash_config.mask_token_id")
        theta, scaling = _rope_of(d)
        known = {"format_version", "method", "target_layer_ids", "aux_layer_id_convention", "target", "target_path"}
        return cls(
            hidden_size=d["hidden_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            num_hidden_layers=d["num_hidden_layers"],
            target_layer_ids=[int(i) for i in ids],
            num_target_layers=int(d.get("num_target_layers") or dflash.get("num_target_layers") or 0),
            block_size=int(dflash.get("block_size", d.get("block_size", 16))),
            mask_token_id=int(dflash["mask_token_id"]),
            mask_token=dflash.get("mask_token"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            target=ours.get("target", ""),
            target_path=ours.get("target_path", ""),
            extra={k: v for k, v in ours.items() if k not in known},
        )

    def as_record(self) -> dict:
        return asdict(self)

    @property
    def aux_layer_ids(self) -> list[int]:
        """The stored aux layers this drafter reads (the name every method's config shares)."""
        return self.target_layer_ids


@dataclass(frozen=True)
class DFlashSettings:
    """config `train.dflash` as the trainer reads it (the target layers come resolved, as the
    drafter's `aux_layer_ids`; see config.schema.yaml for each key)."""

    num_hidden_layers: int = 1
    block_size: int = 16
    mask_token_id: int | None = None
    anchors_per_sample: int = 512
    loss_decay_gamma: float = 7.0
    labels: str = "target"
    # decay, not the schema's dpace: settings without the key are runs from before D-PACE existed
    # (the workflow's params still leave it out for decay, so an explicit decay run keeps its params)
    loss_weighting: str = "decay"
    dpace_alpha: float = 0.5

    @classmethod
    def from_dict(cls, values: dict | None) -> "DFlashSettings":
        from draftflow.errors import reject_unknown_keys

        values = dict(values or {})
        values.pop("target_layer_ids", None)  # resolved by the workflow into aux_layer_ids
        reject_unknown_keys(values, {f for f in cls.__dataclass_fields__}, "train --settings: dflash")
        s = cls(**values)
        if s.block_size < 2:
            raise DraftflowError("train.dflash.block_size must be >= 2 (the anchor and at least one draft)")
        if s.num_hidden_layers < 1 or s.anchors_per_sample < 1:
            raise DraftflowError("train.dflash.num_hidden_layers and anchors_per_sample must be >= 1")
        if s.loss_decay_gamma <= 0:
            raise DraftflowError("train.dflash.loss_decay_gamma must be > 0")
        if s.labels not in LABELS:
            raise DraftflowError(f"train.dflash.labels must be target, data or soft, got {s.labels!r}")
        if s.loss_weighting not in WEIGHTINGS:
            raise DraftflowError(f"train.dflash.loss_weighting must be decay or dpace, got {s.loss_weighting!r}")
        if not 0.0 < s.dpace_alpha <= 1.0:
            raise DraftflowError(f"train.dflash.dpace_alpha must be in (0, 1], got {s.dpace_alpha}")
        return s


# ---------------------------------------------------------------- the mask token


def resolve_mask_token(
    tokenizer, vocab_size: int, configured: int | None = None, embedding: torch.Tensor | None = None
) -> tuple[int, str | None]:
    """(mask token id, its string or None): the embedding row the block's masked positions read.

    Requirements: inside the target's embedding (engines cannot grow it), never a block's first
    token (blocks start at a loss token), and a row that is not all zeros: with a zero row the
    masked rows enter the first layer as zeros, their queries are zero, and its attention can
    never learn (pad rows often are zero). `configured` (train.dflash.mask_token_id) wins if it
    qualifies. Otherwise, in order: the tokenizer's mask token; a `<|MASK|>` token; an embedding
    row past the tokenizer's tokens (Qwen3 has such rows; SGLang picks the first when it adds
    `<|MASK|>` itself); a reserved special token; the BOS token (never a loss token in chat
    data); the pad token. `embedding` [V, H]: the target's, to skip zero rows.
    """

    def string_of(i: int) -> str | None:
        if tokenizer is None or i >= len(tokenizer):
            return None
        token = tokenizer.convert_ids_to_tokens(i)
        return token if isinstance(token, str) else None

    norms = None if embedding is None else embedding.float().norm(dim=-1)
    floor = 0.0 if norms is None else 1e-3 * float(norms.median())

    def usable(i) -> bool:
        return i is not None and 0 <= int(i) < vocab_size and (norms is None or float(norms[int(i)]) > floor)

    if configured is not None:
        if not 0 <= configured < vocab_size:
            raise DraftflowError(f"train.dflash.mask_token_id {configured} is outside the target vocabulary [0, {vocab_size})")
        if not usable(configured):
            raise DraftflowError(
                f"train.dflash.mask_token_id {configured}: its row of the target's embedding is all zeros, so the "
                "drafter's attention could not learn from the masked positions; pick a token with a trained row"
            )
        return int(configured), string_of(int(configured))
    if tokenizer is None:
        raise DraftflowError("DFlash needs a mask token id: set train.dflash.mask_token_id (no tokenizer to pick one)")
    vocab = tokenizer.get_vocab()
    candidates: list = [getattr(tokenizer, "mask_token_id", None), vocab.get(DEFAULT_MASK_TOKEN)]
    candidates += range(len(tokenizer), vocab_size)
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if "reserved" in t.lower()]
    candidates += sorted(vocab[t] for t in specials if t in vocab)
    candidates += [getattr(tokenizer, "bos_token_id", None)]
    pad = getattr(tokenizer, "pad_token_id", None)
    candidates.append(pad if pad != getattr(tokenizer, "eos_token_id", None) else None)
    for i in candidates:
        if usable(i):
            return int(i), string_of(int(i))
    raise DraftflowError(
        "DFlash needs a mask token that starts no block, inside the target's embedding with a non-zero row: the "
        "tokenizer has no such mask, reserved, BOS or pad token and no spare row; set train.dflash.mask_token_id"
    )


# ---------------------------------------------------------------- layers


class FrozenTensor(nn.Module):
    """A frozen target tensor (embedding or LM head): a non-persistent buffer, so it is neither
    trained nor sharded, synchronized or saved; the engines use the target's own."""

    def __init__(self, num: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num, dim, dtype=torch.bfloat16), persistent=False)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H, self.heads, self.kv_heads, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, S, _ = x.shape  # [B, S, n*d] -> [B, n, S, d]
        return x.view(B, S, n, self.head_dim).transpose(1, 2)

    def _expand(self, x: torch.Tensor) -> torch.Tensor:
        """GQA: repeat kv heads to the query heads (keeps SDPA on its fused masked kernels)."""
        return x if self.kv_heads == self.heads else x.repeat_interleave(self.heads // self.kv_heads, dim=1)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] (normed) -> k, v [B, heads, S, d]: RoPE'd, k-normed, GQA-expanded."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.kv_heads)), cos, sin)
        v = self._heads(self.v_proj(x), self.kv_heads)
        return self._expand(k), self._expand(v)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] (normed) -> q [B, heads, S, d]: q-normed, RoPE'd."""
        return apply_rope(self.q_norm(self._heads(self.q_proj(x), self.heads)), cos, sin)

    def forward(self, x, cos, sin, attend: "BlockAttention", layer: int) -> torch.Tensor:
        B, S, _ = x.shape  # x [B, S, H]: the block rows, after input_layernorm
        q = self.query(x, cos, sin)
        k, v = self.key_value(x, cos, sin)
        out = attend.attend(layer, q, k, v)  # [B, heads, S, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attend: "BlockAttention", layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------- attention over context + block


class BlockAttention:
    """Where a layer's block queries find their keys: context rows (projected by `DFlashDrafter.
    context_kv`) plus the block's own rows."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ContextCache(BlockAttention):
    """Inference: the projected context keys/values of every verified position (what the engines
    keep in the drafter's KV cache). One block at a time sees all of them and all of itself."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers  # [B, heads, C, d]
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for i, (k, v) in enumerate(kv):
            self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k], dim=2)
            self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v], dim=2)

    def attend(self, layer, q, k, v):
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        return F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask


def anchored_block_mask(anchors: torch.Tensor, block_size: int, context: int) -> torch.Tensor:
    """[B, 1, n*bs, context + n*bs] bool for anchors [B, n]: block j's rows see the context
    rows t < anchors[:, j] and every row of block j, nothing else."""
    B, n = anchors.shape
    rows = n * block_size
    sees_ctx = torch.arange(context, device=anchors.device) < anchors.repeat_interleave(block_size, dim=1)[..., None]
    block_of = torch.arange(rows, device=anchors.device) // block_size
    own = (block_of[:, None] == block_of[None, :]).expand(B, rows, rows)
    return torch.cat([sees_ctx, own], dim=2)[:, None]


CONTEXT_BUCKET = 256  # context lengths of the training attention are rounded up to a multiple of this


def _leading_rows(pieces: Sequence[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The first n rows along dim 2 of the tensor split into `pieces` (full pieces while they last),
    zero rows appended past its end (to be masked). Whole pieces, not a slice of the full tensor:
    a slice's backward is a full-size zero tensor and an add, for every group and layer."""
    out, have = [], 0
    for piece in pieces:
        if have >= n:
            break
        out.append(piece)
        have += piece.shape[2]
    if have < n:
        x = pieces[0]
        out.append(x.new_zeros(x.shape[0], x.shape[1], n - have, x.shape[3]))
    return out


class AnchoredBlocks(BlockAttention):
    """Training: n blocks per sample, all in one forward (the query rows are the blocks one after
    another). Block j, anchored at a_j, sees the context rows t < a_j and its own rows: exactly
    the drafter's view at inference after the target verified x_0 .. x_{a_j}.

    Blocks go through attention in groups of `group` (anchors ascending): a group needs the
    context only up to its largest anchor, which bounds the masked attention's size. That length
    is rounded up to a multiple of `context_bucket` (the extra rows are masked out): every batch's
    anchors differ, and each new key length made cuDNN build new attention plans on the host,
    ~1.5 s a step for an 8B-shaped drafter, which idled the GPU. `anchor_column_max` [n] (the
    batch's largest anchor per column, from the data loader) gives the lengths without reading
    the anchors back from the GPU; without it they are read once.
    """

    def __init__(self, context_kv: list[tuple[torch.Tensor, torch.Tensor]], anchors: torch.Tensor, block_size: int,
                 group: int = 64, anchor_column_max: Sequence[int] | None = None,
                 context_bucket: int = CONTEXT_BUCKET):  # fmt: skip
        self.context_kv = context_kv  # per layer: k, v [B, heads, T, d]
        self.anchors, self.block_size, self.group = anchors, block_size, group  # anchors [B, n]
        n = anchors.shape[1]
        if anchor_column_max is None:
            anchor_column_max = anchors.max(dim=0).values.tolist() if anchors.numel() else [-1] * n
        if len(anchor_column_max) != n:
            raise ValueError(f"anchor_column_max has {len(anchor_column_max)} values for {n} anchor columns")
        self.context_bucket = context_bucket
        self._groups = []  # (context length, mask) per group of anchors
        for g0 in range(0, n, group):
            g1 = min(n, g0 + group)
            needed = max(0, *anchor_column_max[g0:g1])
            context = -(-needed // context_bucket) * context_bucket
            self._groups.append((context, anchored_block_mask(anchors[:, g0:g1], block_size, context)))

    def attend(self, layer, q, k, v):
        ck, cv = self.context_kv[layer]  # [B, heads, T, d]
        ck_pieces, cv_pieces = ck.split(self.context_bucket, dim=2), cv.split(self.context_bucket, dim=2)
        rows = self.group * self.block_size  # query rows of a group (the last may have fewer)
        outs = []
        for (context, mask), q_g, k_g, v_g in zip(self._groups, q.split(rows, 2), k.split(rows, 2), v.split(rows, 2)):
            K = torch.cat([*_leading_rows(ck_pieces, context), k_g], dim=2)
            V = torch.cat([*_leading_rows(cv_pieces, context), v_g], dim=2)
            outs.append(F.scaled_dot_product_attention(q_g, K, V, attn_mask=mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


# ---------------------------------------------------------------- the model


class DFlashDrafter(nn.Module):
    """DFlash drafter.

    Inference, with `cache = ContextCache(drafter.num_layers)`:
    1. after the target verified positions p .. n-1 (aux [B, S, n_ids, H] their states):
       `cache.append(drafter.context_kv(drafter.context(aux), positions))`;
    2. draft a block: ids [last verified token x_n, mask × (B-1)] at positions n .. n+B-1:
       `logits = drafter.draft(ids, positions, cache)`; row k (>= 1) drafts x_{n+k};
    3. after verification accepted m drafts, go to 1 with the m + 1 new positions
       (x_n and the accepted drafts): their target states come from the verify forward.
    """

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = FrozenTensor(cfg.vocab_size, H)  # set both from the target before use
        self.lm_head = FrozenTensor(cfg.vocab_size, H)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.reset_parameters()

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def reset_parameters(self, std: float = 0.02) -> None:
        init_linears_and_norms(self, std)

    def compile_pointwise(self) -> None:
        """torch.compile the norms, MLPs and attention projections in place (as
        `Eagle3Drafter.compile_pointwise`: the head norm, RoPE and GQA expansion in one pass each way)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, MLP)):
                m.compile(dynamic=True)
            elif isinstance(m, DFlashAttention):
                m.query = torch.compile(m.query, dynamic=True)
                m.key_value = torch.compile(m.key_value, dynamic=True)

    def set_target(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.embed_tokens.weight = embed
        self.lm_head.weight = lm_head

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, S, n_ids, H] or [B, S, n_ids*H] (order of target_layer_ids) -> c [B, S, H]."""
        if aux.dim() == 4:
            aux = aux.flatten(-2)
        if not torch.is_autocast_enabled(aux.device.type):
            aux = aux.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(aux))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """c [B, S, H], positions [B, S] -> per layer (k, v) [B, heads, S, d] of those rows."""
        cos, sin = self.rotary(positions)
        return [layer.self_attn.key_value(c, cos, sin) for layer in self.layers]

    def forward_blocks(self, ids: torch.Tensor, positions: torch.Tensor, attend: BlockAttention) -> torch.Tensor:
        """ids, positions [B, Q] (block rows) -> normed hidden [B, Q, H] (logits: `logits`)."""
        x = F.embedding(ids, self.embed_tokens.weight).to(self.fc.weight.dtype)  # the residual stream
        cos, sin = self.rotary(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attend, i)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.weight.to(hidden.dtype).T

    def draft(self, ids: torch.Tensor, positions: torch.Tensor, cache: ContextCache) -> torch.Tensor:
        """One block (see the class docstring): ids, positions [B, bs] -> logits [B, bs, V]."""
        return self.logits(self.forward_blocks(ids, positions, cache))

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors (embedding, LM head and RoPE tables are not part of it)."""
        return dict(self.state_dict())


def loss_decay(gamma: float) -> float:
    """Per-position weight ratio of DFlash's loss: position k weighs exp(-(k-1)/γ)."""
    return math.exp(-1.0 / gamma)
