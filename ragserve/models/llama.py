"""The Llama family for serving: Llama, Mistral, Qwen2, Qwen3 (and SmolLM2, a Llama).

One implementation, configured by ``ArchFlags``: GQA, fused qkv and gate/up projections,
optional qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied or untied embeddings, rotary
scaling (see ``rotary.py``). Sliding-window attention is refused.

The model runs a flat batch of tokens from many sequences: ``forward(input_ids [T],
positions [T]) -> hidden [T, hidden_size]``, or with ``output_rows`` (the rows sampled from)
``hidden [R, hidden_size]``, whose last layer runs only those rows past their K/V. Attention
reads the paged KV cache and metadata from ``get_forward_context()``. Op order follows transformers so float32 logits match it
closely and greedy outputs are token-identical.

Parameter names mirror HF checkpoints except for the fused ``qkv_proj`` and ``gate_up_proj``;
``load_weights`` takes HF names and writes each shard into its slice of the fused weight.
With ``quantization="fp8"`` the four projections of each layer are ``Fp8Linear``s
(``fp8_linear.py``), which take float shards (quantized on arrival) or FP8 shards with their
``weight_scale``. Where one quantizes its input, the norm or SiLU before it writes that input
quantized (``_quantizes_input``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_layer_ops
from kernels.cpu_decoder_stack import StackWeights
from kernels.cpu_linear import (
    PAIRS_MAX_BYTES,
    WIDE_MAX_BYTES,
    can_pack,
    kept_transposed,
    max_rows,
    pack_weight,
    packed_linear,
    pair_weight,
    pairs_apply,
    pairs_linear,
    small_linear,
    small_linear_usable,
    store_transposed,
    widens,
)
from ragserve.models.forward_context import OutputRows, get_forward_context
from ragserve.models.fp8_linear import Fp8Linear, QuantizedRows
from ragserve.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    fused_fp8_ops,
    fused_ops,
    use_fused_kernels,
)
from ragserve.models.native_layers import run_native_layers, shapes_fit
from ragserve.models.rotary import RotaryEmbedding, Rotation, compute_inv_freq, rope_parameters

# HF projection name -> (our fused projection, shard index within it)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

logger = logging.getLogger(__name__)

# Checkpoint scales this engine computes for itself (see ``load_weights``).
_UNUSED_SCALES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")


@dataclass(frozen=True)
class ModelShape:
    """The sizes the engine needs to lay out the KV cache and sample."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


# Values of ``--quantization``: how the decoder's linear layers hold their weights.
QUANTIZATIONS = ("none", "fp8")


def linear_class(quantization: str) -> type[Linear] | type[Fp8Linear]:
    """The decoder's projections: ``Linear`` in the model dtype, or ``Fp8Linear``.

    NOTE: only the decoder's projections; the embedding and LM head stay in the model
    dtype (one row read per token, and the logits are the most sensitive to rounding).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    return Fp8Linear if quantization == "fp8" else Linear


def _quantizes_input(linear: nn.Module, rows: int) -> bool:
    """Whether ``linear`` takes its input of ``rows`` rows as :class:`QuantizedRows`, made by
    the fused kernel that computes it (``kernels/fused_fp8_ops.py``) instead of bf16 rows the
    linear would read back only to quantize them. The one place the decoder decides it."""
    return isinstance(linear, Fp8Linear) and linear.wants_quantized_input(rows)


def _norm_into(
    norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None, linear: nn.Module
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """``(norm(hidden + residual), hidden + residual)`` (without ``residual``, of ``hidden``
    alone), the first in the form ``linear``, its consumer, takes."""
    if _quantizes_input(linear, hidden.shape[0]):
        codes, scales = fused_fp8_ops().add_rms_norm_quant(hidden, norm.weight, norm.eps, residual)
        return QuantizedRows(codes, scales), hidden if residual is None else residual
    if residual is None:
        return norm(hidden), hidden
    return norm.add_forward(hidden, residual)


@dataclass(frozen=True)
class ArchFlags:
    """What distinguishes the members of the family."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def shape_from_config(config: Any) -> ModelShape:
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return ModelShape(
        num_layers=int(config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
    )


def check_no_sliding_window(config: Any, max_model_len: int) -> None:
    """Refuse configs whose attention is windowed within ``max_model_len`` tokens.

    A window at least as long as the longest sequence is plain causal attention. Mistral
    windows every layer; Qwen2/Qwen3 list windowed layers in ``layer_types``.
    """
    window = getattr(config, "sliding_window", None)
    if window is None:
        return
    layer_types = getattr(config, "layer_types", None)
    windowed = layer_types is None or "sliding_attention" in layer_types
    if windowed and window < max_model_len:
        raise ValueError(
            f"{type(config).__name__} uses sliding-window attention (window {window} < "
            f"max_model_len {max_model_len}); sliding windows are not supported: "
            f"pass max_model_len <= {window} or use a model without one"
        )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        shape: ModelShape,
        flags: ArchFlags,
        layer_idx: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str = "none",
    ) -> None:
        super().__init__()
        linear = linear_class(quantization)
        self.layer_idx = layer_idx
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.scale = shape.head_dim**-0.5
        self.hidden_size = shape.hidden_size
        self.qkv_proj = linear(
            shape.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=flags.qkv_bias,
            device=device,
            dtype=dtype,
        )
        self.o_proj = linear(
            self.q_size, shape.hidden_size, bias=flags.o_proj_bias, device=device, dtype=dtype
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if flags.qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(shape.head_dim, eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(shape.head_dim, eps, device=device, dtype=dtype)

    def forward(
        self,
        hidden: torch.Tensor | QuantizedRows,
        rotation: Rotation,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Attention output ``[T, hidden]``, or ``[R, hidden]`` of ``output_rows`` only."""
        qkv = self.qkv_proj(hidden)
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None and not rotation.fused and qkv.device.type == "cpu":
            # NOTE: q and k are adjacent columns of qkv: rotating them as one [T, heads +
            # kv_heads, D] view is the same arithmetic with half the small ops. CPU only:
            # q and k come out as strided views, which GPU kernels are not written for.
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
            q, k = rotation.rotate_heads(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotation.rotate(q, k)
        ctx = get_forward_context()
        kv_layer = ctx.kv_cache[:, self.layer_idx]
        if output_rows is None:
            out = ctx.backend.forward(q, k, v, kv_layer, ctx.meta, self.scale)
        else:
            # Later tokens attend to every row's K/V, but only these rows' outputs are read.
            ctx.backend.store_kv(k, v, kv_layer, ctx.meta.slot_mapping)
            if output_rows.count == 0:
                return qkv.new_empty(0, self.hidden_size)
            rows = output_rows.indices
            out = ctx.backend.forward(
                q[rows], k[rows], v[rows], kv_layer, output_rows.meta, self.scale
            )
        return self.o_proj(out.reshape(out.shape[0], self.q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        shape: ModelShape,
        flags: ArchFlags,
        *,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str = "none",
    ) -> None:
        super().__init__()
        linear = linear_class(quantization)
        self.intermediate_size = shape.intermediate_size
        self.gate_up_proj = linear(
            shape.hidden_size,
            2 * shape.intermediate_size,
            bias=flags.mlp_bias,
            device=device,
            dtype=dtype,
        )
        self.down_proj = linear(
            shape.intermediate_size,
            shape.hidden_size,
            bias=flags.mlp_bias,
            device=device,
            dtype=dtype,
        )

    def forward(self, hidden: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(self.gate_up_proj, Linear) and isinstance(hidden, torch.Tensor):
            activated = self.gate_up_proj.pairs_silu_mul(hidden, self.intermediate_size)
            if activated is not None:
                return self.down_proj(activated)
        gate_up = self.gate_up_proj(hidden)
        if _quantizes_input(self.down_proj, gate_up.shape[0]):
            codes, scales = fused_fp8_ops().silu_and_mul_quant(gate_up)
            return self.down_proj(QuantizedRows(codes, scales))
        if use_fused_kernels(gate_up):
            return self.down_proj(fused_ops().silu_and_mul(gate_up))
        if gate_up.dim() == 2 and cpu_layer_ops.usable(gate_up):
            return self.down_proj(cpu_layer_ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        shape: ModelShape,
        flags: ArchFlags,
        layer_idx: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str = "none",
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(shape.hidden_size, eps, device=device, dtype=dtype)
        self.self_attn = LlamaAttention(
            config, shape, flags, layer_idx, device=device, dtype=dtype, quantization=quantization
        )
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps, device=device, dtype=dtype)
        self.mlp = LlamaMLP(shape, flags, device=device, dtype=dtype, quantization=quantization)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotation: Rotation,
        output_rows: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``; the caller adds them (in the next layer's norm).

        With ``output_rows``, both come back for those rows only (the model's last layer).

        NOTE: the same additions as HF's ``hidden + sublayer(norm(hidden))``, in the model
        dtype, only carried one step later so that each add fuses with the norm after it.
        """
        normed, residual = _norm_into(
            self.input_layernorm, hidden, residual, self.self_attn.qkv_proj
        )
        hidden = self.self_attn(normed, rotation, output_rows)
        if output_rows is not None:
            if output_rows.count == 0:
                return hidden, residual[:0]
            residual = residual[output_rows.indices]
        normed, residual = _norm_into(
            self.post_attention_layernorm, hidden, residual, self.mlp.gate_up_proj
        )
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        shape: ModelShape,
        flags: ArchFlags,
        max_positions: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str = "none",
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(
            shape.vocab_size, shape.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, shape, flags, i, device=device, dtype=dtype, quantization=quantization
            )
            for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        # Whether small CPU steps may run the layers in one native call (native_layers.py),
        # and the weight pointers that call takes, gathered on first use.
        self.native_shapes = shapes_fit(shape, flags.qk_norm, quantization)
        self.native_weights: StackWeights | None = None
        inv_freq, attention_scaling = compute_inv_freq(
            rope_parameters(config), shape.head_dim, int(config.max_position_embeddings)
        )
        self.rotary_emb = RotaryEmbedding(
            inv_freq, attention_scaling, max_positions, device=device, dtype=dtype
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rotation = self.rotary_emb(positions)
        residual: torch.Tensor | None = None
        done = 0
        native = run_native_layers(self, hidden, rotation, output_rows)
        if native is not None:
            hidden, residual, done = native
        last = len(self.layers) - 1
        for index in range(done, len(self.layers)):
            # The last layer computes its output for the needed rows only: in a long
            # prompt's prefill that skips nearly 1/num_layers of the work (3% for Llama-3.1-8B).
            hidden, residual = self.layers[index](
                hidden, residual, rotation, output_rows if index == last else None
            )
        if residual is None:  # a model without layers
            return self.norm(hidden if output_rows is None else hidden[output_rows.indices])
        if hidden.shape[0] == 0:
            return hidden
        return self.norm.add_forward(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over a flat, paged batch. Weights are uninitialised until loaded.

    ``max_model_len`` bounds the positions served (rotary tables are built up to it) and
    defaults to the config's ``max_position_embeddings``.
    """

    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return ArchFlags(
            qkv_bias=attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def __init__(
        self,
        config: Any,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int | None = None,
        quantization: str = "none",
    ) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # NOTE: one function under two names
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu', or 'swish')")
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        check_no_sliding_window(config, self.max_model_len)
        self.config = config
        self.shape = shape_from_config(config)
        self.flags = self.arch_flags(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.quantization = quantization
        self.model = LlamaModel(
            config,
            self.shape,
            self.flags,
            self.max_model_len,
            device=device,
            dtype=dtype,
            quantization=quantization,
        )
        self.lm_head: Linear | None = None
        if not self.tie_word_embeddings:
            self.lm_head = Linear(
                self.shape.hidden_size,
                self.shape.vocab_size,
                bias=False,
                device=device,
                dtype=dtype,
            )
        # Copies of the tied embedding for the LM head on the CPU, see pack_cpu_weights:
        # oneDNN's (bf16), stored transposed for the native products of a few rows (float32).
        self._packed_tied_head: torch.Tensor | None = None
        self._transposed_tied_head: torch.Tensor | None = None
        self._paired_tied_head: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.shape.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden_size]`` of the flat batch ``input_ids [T]``,
        or ``[R, hidden_size]`` of ``output_rows`` alone (computed exactly, with less work)."""
        return self.model(input_ids, positions, output_rows)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab_size]`` of hidden rows ``[N, hidden_size]``."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        weight = self.model.embed_tokens.weight
        small = self._transposed_tied_head if self._transposed_tied_head is not None else weight
        if small_linear_usable(hidden, small, self._paired_tied_head):
            return small_linear(hidden, small, None, self._paired_tied_head).float()
        if self._paired_tied_head is not None and hidden.dtype == weight.dtype:
            return pairs_linear(hidden, self._paired_tied_head, None, weight.shape[0]).float()
        if self._packed_tied_head is not None and hidden.dtype == weight.dtype:
            return packed_linear(hidden, self._packed_tied_head, None).float()
        return F.linear(hidden, weight).float()

    def pack_cpu_weights(self) -> None:
        """Prepack every bf16 CPU projection and the LM head (``kernels/cpu_linear.py``),
        and forget the native layers' weight pointers (``native_layers.py``).

        Packing is a no-op for other dtypes and devices. ``load_weights`` calls it; call it
        again after writing weights any other way. Costs one extra copy of those weights in
        memory: paired where the CPU has AVX-512 BF16 and no AMX (while the copies take at
        most ``PAIRS_MAX_BYTES``), else packed for oneDNN; and where long bf16 products run in
        float32 a float32 copy of the projections too, unless that would pass
        ``WIDE_MAX_BYTES``. A float32 model whose
        LM head is its embedding keeps a transposed copy of it for the native products of a
        few rows (the projections are stored transposed already, see ``Linear``).
        """
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        wide_bytes = 4 * sum(module.weight.numel() for module in linears)
        widen = wide_bytes <= WIDE_MAX_BYTES
        pair = wide_bytes // 2 <= PAIRS_MAX_BYTES
        if not widen and any(widens(module.weight) for module in linears):
            logger.info(
                "long bf16 products stay in bf16: float32 copies of the projections would "
                "take %.1f GiB (more than %.1f)", wide_bytes / 2**30, WIDE_MAX_BYTES / 2**30,
            )  # fmt: skip
        for module in linears:
            module.pack_for_cpu(widen, pair)
        self.model.native_weights = None  # gathered again from the weights as they are now
        tied = self.model.embed_tokens.weight if self.lm_head is None else None
        self._paired_tied_head = (
            pair_weight(tied) if pair and tied is not None and pairs_apply(tied) else None
        )
        self._packed_tied_head = (
            pack_weight(tied)
            if tied is not None and self._paired_tied_head is None and can_pack(tied)
            else None
        )
        self._transposed_tied_head = (
            store_transposed(tied)
            if tied is not None and kept_transposed(tied) and max_rows(tied.dtype) > 0
            else None
        )

    def set_rope_frequency_factors(self, factors: torch.Tensor) -> None:
        """Divide the rotary inverse frequencies by ``factors`` (GGUF ``rope_freqs``)."""
        self.model.rotary_emb.divide_frequencies(factors)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters (casting dtype, moving device).

        Raises ValueError on an unknown name, a shape mismatch, or when any parameter (or
        shard of a fused one) was not provided. ``lm_head.weight`` is ignored when tied.
        An ``Fp8Linear`` takes float shards (quantized as they come) or e4m3 ones with their
        ``weight_scale``; any other FP8 tensor is refused.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            # NOTE: the static scales of an FP8 checkpoint are not used: activations get
            # dynamic per-token scales, and an FP8 KV cache its own per-block ones, which fit
            # at least as well.
            if name.endswith(_UNUSED_SCALES):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, shard = self._resolve(name)
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint weight {name!r} has no place in {type(self).__name__}"
                )
            module_name, kind = target.rsplit(".", 1)
            module = modules[module_name]
            if isinstance(module, Fp8Linear) and kind in ("weight", "weight_scale"):
                start, size = (
                    (0, param.shape[0]) if shard is None else self._shard_rows(target, shard)
                )
                try:
                    filled = module.load(kind, tensor, start, size)
                except ValueError as exc:
                    raise ValueError(f"weight {name!r} {exc}") from None
                loaded.update((f"{module_name}.{part}", shard) for part in filled)
                continue
            if tensor.dtype == torch.float8_e4m3fn:
                raise ValueError(
                    f"weight {name!r} is stored in FP8, but {target} holds the model's dtype "
                    "(only the decoder's projections may be FP8)"
                )
            dest = param.data if shard is None else self._shard_view(param.data, target, shard)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add((target, shard))
        missing = sorted(
            f"{n}[shard {s}]" if s is not None else n
            for n, s in self._expected_slots(params)
            if (n, s) not in loaded
        )
        if missing:
            raise ValueError(
                f"{len(missing)} weights missing from the checkpoint, e.g. {missing[:5]}"
            )
        self.pack_cpu_weights()

    @staticmethod
    def _resolve(name: str) -> tuple[str, int | None]:
        for hf_proj, (fused, shard) in _FUSED_SHARDS.items():
            marker = f".{hf_proj}."
            if marker in name:
                return name.replace(marker, f".{fused}."), shard
        return name, None

    def _shard_rows(self, target: str, shard: int) -> tuple[int, int]:
        """``(first row, rows)`` of a shard within its fused projection."""
        if ".qkv_proj." in target:
            q_size = self.shape.num_heads * self.shape.head_dim
            kv_size = self.shape.num_kv_heads * self.shape.head_dim
            return [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)][shard]
        size = self.shape.intermediate_size
        return shard * size, size

    def _shard_view(self, data: torch.Tensor, target: str, shard: int) -> torch.Tensor:
        return data.narrow(0, *self._shard_rows(target, shard))

    @staticmethod
    def _expected_slots(params: dict[str, nn.Parameter]) -> list[tuple[str, int | None]]:
        slots: list[tuple[str, int | None]] = []
        for name in params:
            if ".qkv_proj." in name:
                slots.extend((name, s) for s in range(3))
            elif ".gate_up_proj." in name:
                slots.extend((name, s) for s in range(2))
            else:
                slots.append((name, None))
        return slots


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        return ArchFlags()


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        return ArchFlags(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_flags(cls, config: Any) -> ArchFlags:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return ArchFlags(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm=True)
