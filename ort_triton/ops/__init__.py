"""Every fused op, one contract each. Adding an op = adding its module here."""

from __future__ import annotations

from ..contract import OpContract
from .attention import MULTI_HEAD_ATTENTION
from .bias_gelu import BIAS_GELU, BIAS_GELU_TANH
from .layer_norm import ADD_LAYER_NORM, LAYER_NORM

ALL_OPS: tuple[OpContract, ...] = (LAYER_NORM, ADD_LAYER_NORM, BIAS_GELU, BIAS_GELU_TANH, MULTI_HEAD_ATTENTION)
BY_NAME: dict[str, OpContract] = {op.name: op for op in ALL_OPS}
