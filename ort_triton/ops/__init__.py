"""Every fused op, one contract each. Adding an op = adding its module here."""

from __future__ import annotations

from ..contract import OpContract
from .attention import MULTI_HEAD_ATTENTION
from .bias_gelu import BIAS_GELU, BIAS_GELU_MUL, BIAS_GELU_TANH, BIAS_GELU_TANH_MUL
from .causal_attention import CAUSAL_ATTENTION
from .embed_layer_norm import EMBED_LAYER_NORM
from .layer_norm import ADD_LAYER_NORM, LAYER_NORM
from .linear import LINEAR
from .norm_linear import ADD_RMS_NORM_LINEAR, ADD_RMS_NORM_SWIGLU
from .packed_attention import PACKED_MULTI_HEAD_ATTENTION
from .qkv_cache import QKV_CACHE
from .qkv_rotary_cache import QKV_NORM_ROTARY_CACHE, QKV_ROTARY_CACHE
from .rms_norm import ADD_RMS_NORM, RMS_NORM
from .rotary import ROTARY, TRANSPOSE_ROTARY
from .swiglu import SILU_MUL

ALL_OPS: tuple[OpContract, ...] = (LAYER_NORM, ADD_LAYER_NORM, BIAS_GELU, BIAS_GELU_TANH, MULTI_HEAD_ATTENTION)
ALL_OPS += (RMS_NORM, ADD_RMS_NORM)
ALL_OPS += (CAUSAL_ATTENTION,)
ALL_OPS += (PACKED_MULTI_HEAD_ATTENTION,)
ALL_OPS += (SILU_MUL, ROTARY)
ALL_OPS += (EMBED_LAYER_NORM,)
ALL_OPS += (TRANSPOSE_ROTARY,)
ALL_OPS += (QKV_ROTARY_CACHE,)
ALL_OPS += (QKV_CACHE,)
ALL_OPS += (LINEAR,)
ALL_OPS += (ADD_RMS_NORM_LINEAR, ADD_RMS_NORM_SWIGLU)
ALL_OPS += (QKV_NORM_ROTARY_CACHE,)
ALL_OPS += (BIAS_GELU_MUL, BIAS_GELU_TANH_MUL)
BY_NAME: dict[str, OpContract] = {op.name: op for op in ALL_OPS}
