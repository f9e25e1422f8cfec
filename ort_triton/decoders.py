"""Decoder (causal LM) models built from `transformers` configs (random weights, nothing downloaded), their
ONNX exports with a KV cache by either torch exporter, and greedy generation on an ORT session.

    model = build("llama-tiny")                               # *ForCausalLM, eval, perturbed weights
    export(model, "m.onnx", exporter="dynamo")                # cache=True, opset None or 23
    feeds = sample_inputs(model, batch=2, seq=5, past=3)      # numpy feeds for the cache=True export
    tokens = greedy(session, model.config, input_ids, steps=16)

The cache=True export: inputs input_ids [B, S] int64, attention_mask [B, P+S] int64 (1 = token, 0 = left
padding), past_key_{i} / past_value_{i} [B, n_kv_heads, P, head_dim]; outputs logits [B, S, V] and
present_key_{i} / present_value_{i} [B, n_kv_heads, P+S, head_dim]. P may be 0 (prefill) and S 1
(decode): one model serves both. Position ids are not an input: the graph derives them from the mask the
way `generate` does (cumsum - 1, 0 on padding), so left-padded batches get the positions `generate` gives.
cache=False: (input_ids, attention_mask [B, S]) -> logits.
"""

from __future__ import annotations

import inspect
import pathlib

import numpy as np

_SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,  # head dim 32
              intermediate_size=176, vocab_size=512, max_position_embeddings=256)
CONFIGS = {
    # name: (transformers config class, kwargs). Head dims: the encoder attention kernel takes 32, 40, 64, 80, 96, 128,
    # the decoder's (CausalAttention) those and 256.
    "llama-tiny": ("LlamaConfig", _SMALL),
    # one kv head (MQA: repeat_kv x4); no sliding window: its cache crops to the window, a mask of another shape
    "mistral-tiny": ("MistralConfig", dict(_SMALL, num_key_value_heads=1, sliding_window=None)),
    "qwen2-tiny": ("Qwen2Config", _SMALL),  # q/k/v projections with biases
    "qwen3-tiny": ("Qwen3Config", dict(_SMALL, head_dim=32)),  # q and k RMSNorm-ed per head before the rotary
    # GeGLU MLP (gelu_tanh(gate) * up), RMSNorm with (1 + weight), the embeddings scaled by sqrt(hidden), tied lm_head,
    # Gemma's head dim of 256 (wider than the hidden size here, as in Gemma-2B's 8 x 256 = 2048)
    "gemma-tiny": ("GemmaConfig", dict(_SMALL, head_dim=256)),
    # an odd vocabulary, as GPT-2's 50257: the lm_head's rows unaligned, and wide enough for padded_weight
    "gpt2-tiny": ("GPT2Config", dict(n_embd=128, n_layer=2, n_head=4, vocab_size=4099, n_positions=256)),
    # partial rotary (16 of 32 dims), LayerNorm, GELU MLP in parallel with attention, biases everywhere
    "phi-tiny": ("PhiConfig", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   intermediate_size=256, vocab_size=512, max_position_embeddings=256,
                                   partial_rotary_factor=0.5)),
    # GPU sizes. llama-1b: Llama-3.2-1B's shape (head dim 64, GQA 4:1) with Llama-2's vocabulary.
    "llama-1b": ("LlamaConfig", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                     num_key_value_heads=8, intermediate_size=8192, vocab_size=32000,
                                     max_position_embeddings=8192)),
    # Qwen3-0.6B's shape (head dim 128, GQA 2:1, q and k normed per head, tied embeddings) with Llama-2's vocabulary
    "qwen3-0.6b": ("Qwen3Config", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=32000,
                                       max_position_embeddings=8192, tie_word_embeddings=True)),
    # Gemma-2B's shape (MQA, head dim 256, GeGLU MLP of 16384) with Llama-2's vocabulary: what gelu_mul and the
    # attention at head dim 256 buy, on the GPU
    "gemma-2b": ("GemmaConfig", dict(hidden_size=2048, num_hidden_layers=18, num_attention_heads=8,
                                     num_key_value_heads=1, head_dim=256, intermediate_size=16384, vocab_size=32000,
                                     max_position_embeddings=8192)),
    # GPT-2 124M, its position table grown from 1024 to 8192 for the bench's 4096-position decode shapes
    "gpt2-small": ("GPT2Config", dict(n_positions=8192)),
}
EXPORTERS = ("dynamo", "torchscript")
# The shapes the export traces with: S > 1 (transformers' sdpa path takes another branch at S == 1 under the
# TorchScript tracer) and P, S, P+S distinct and > 1 (torch.export specialises sizes 0 and 1).
_TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST = 2, 5, 3


def build(name: str, *, attn_implementation: str = "sdpa", seed: int = 0, dtype=None):
    """An eval-mode transformers *ForCausalLM with random weights for one of CONFIGS (fp32 unless `dtype`)."""
    import torch
    import transformers

    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}")
    cls_name, kwargs = CONFIGS[name]
    # no eos: random weights emit it at random, and `generate` would stop there and pad
    config = getattr(transformers, cls_name)(**kwargs, attn_implementation=attn_implementation,
                                             bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Perturb every parameter: fresh RMSNorm/LayerNorm weights are all ones and biases all zeros, which the
    # dynamo exporter deduplicates into one initializer and which would hide a rewrite that swaps them.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.to(dtype) if dtype is not None else model


def max_positions(config) -> int:
    """How many positions (past + new) the model can take: its position table (GPT-2) or rotary range."""
    config = getattr(config, "config", config)
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def cache_spec(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config (or a model)."""
    config = getattr(config, "config", config)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv, head_dim


def input_names(config, cache: bool = True) -> list[str]:
    layers = cache_spec(config)[0]
    past = [f"past_{kv}_{i}" for i in range(layers) for kv in ("key", "value")] if cache else []
    return ["input_ids", "attention_mask", *past]


def output_names(config, cache: bool = True) -> list[str]:
    layers = cache_spec(config)[0]
    present = [f"present_{kv}_{i}" for i in range(layers) for kv in ("key", "value")] if cache else []
    return ["logits", *present]


def _np_dtype(model):
    import torch

    types = {torch.float32: np.float32, torch.float16: np.float16}
    if model.dtype not in types:
        raise ValueError(f"sample_inputs: model dtype {model.dtype} has no numpy type here (float32, float16)")
    return types[model.dtype]


def sample_inputs(model, batch: int = 2, seq: int = 5, past: int = 3, seed: int = 0, *, left_pad: int = 0,
                  cache: bool = True) -> dict:
    """Numpy feeds by input name: random token ids, a mask of ones over the P+S positions (the last row's
    first `left_pad` positions 0: left padding), random past keys/values [B, n_kv, P, D] in the model's dtype."""
    rng = np.random.default_rng(seed)
    layers, kv, head_dim = cache_spec(model)
    total = past + seq if cache else seq
    if not 0 <= left_pad < total:
        raise ValueError(f"left_pad must be in [0, {total})")
    mask = np.ones((batch, total), np.int64)
    mask[-1, :left_pad] = 0
    feeds = {"input_ids": rng.integers(0, model.config.vocab_size, (batch, seq), dtype=np.int64),
             "attention_mask": mask}
    if cache:
        for name in input_names(model)[2:]:
            feeds[name] = rng.standard_normal((batch, kv, past, head_dim)).astype(_np_dtype(model))
    return feeds


def _positions(attention_mask, seq):
    # what `generate` computes: the index among the row's real tokens; padding gets 0 (it is masked anyway)
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)[:, -seq:]


def output_cache(out):
    """The Cache object of a transformers output (`cache`, or `past_key_values` before 5.2x)."""
    found = getattr(out, "cache", None)
    return found if found is not None else out.past_key_values


def wrap(model, cache: bool = True):
    """The nn.Module that is exported: explicit tensor arguments in, plain tensors out. Runs in torch too
    (the reference the tests compare ORT with)."""
    import torch
    from transformers import DynamicCache

    layers = cache_spec(model)[0]
    # transformers renamed the cache argument and output field past_key_values -> cache (5.2x); the GPU
    # machine's 5.17 has the old names
    cache_arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

    class WithCache(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, *past):
            # transformers 5 takes a Cache object, not tuples: build one around the past tensors (P = 0 too)
            kv = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(layers)], config=self.inner.config)
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                             position_ids=_positions(attention_mask, input_ids.shape[1]), **{cache_arg: kv})
            present = []
            for layer in output_cache(out).layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    class NoCache(WithCache):
        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                              position_ids=_positions(attention_mask, input_ids.shape[1])).logits

    return (WithCache if cache else NoCache)(model).eval()


def _rename_dims(model, axes: dict[str, dict[int, str]]) -> None:
    """Name the symbolic dims of the graph's inputs and outputs (an onnx_ir model) after `axes`: torch.export
    calls them s53 or 'past + seq'."""
    import onnx_ir as ir

    for value in [*model.graph.inputs, *model.graph.outputs]:
        if value.shape is None or value.name not in axes:
            continue
        dims = list(value.shape.dims)
        for axis, name in axes[value.name].items():
            if not isinstance(dims[axis], int):
                dims[axis] = ir.SymbolicDim(name)
        value.shape = ir.Shape(dims)


def export(model, path: str | pathlib.Path, exporter: str = "dynamo", cache: bool = True,
           opset: int | None = None) -> pathlib.Path:
    """Export `model` (from `build`) to ONNX at `path`; dims batch, seq, past, total (= past + seq) dynamic."""
    import torch
    from torch.export import Dim

    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}")
    path = pathlib.Path(path)
    wrapper = wrap(model, cache)
    feeds = sample_inputs(model, _TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST, cache=cache)
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    names, outputs = input_names(model, cache), output_names(model, cache)
    kv_in, kv_out = {0: "batch", 2: "past"}, {0: "batch", 2: "total"}
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total" if cache else "seq"},
            "logits": {0: "batch", 1: "seq"}}
    axes |= {n: kv_in for n in names[2:]} | {n: kv_out for n in outputs[1:]}
    with torch.no_grad():
        if exporter == "dynamo":
            batch, seq = Dim("batch"), Dim("seq")
            # P must accept 0 at run time: min=0 (the trace itself uses P = 3; torch.export would specialise
            # a traced 0 or 1). The mask's length is P + S, which torch.export cannot declare as a sum of two
            # Dims: AUTO lets it derive the relation, and the ONNX dim is renamed "total" below.
            past = Dim("past", min=0)
            shapes = ({0: batch, 1: seq}, {0: batch, 1: Dim.AUTO if cache else seq})
            if cache:
                shapes += (tuple({0: batch, 2: past} for _ in names[2:]),)  # *past is one tuple argument
            prog = torch.onnx.export(wrapper, args, input_names=names, output_names=outputs, dynamo=True,
                                     opset_version=opset, dynamic_shapes=shapes, verbose=False)
            _rename_dims(prog.model, axes)  # on the IR: a model past 2 GiB is never reloaded whole
            prog.save(str(path))
        else:
            torch.onnx.export(wrapper, args, str(path), input_names=names, output_names=outputs, dynamo=False,
                              opset_version=opset or 17, dynamic_axes=axes)
    return path


def _empty_past(config, batch: int, dtype) -> dict:
    layers, kv, head_dim = cache_spec(config)
    return {n: np.zeros((batch, kv, 0, head_dim), dtype) for n in input_names(config)[2:]}


def greedy(session, config, input_ids: np.ndarray, steps: int, attention_mask: np.ndarray | None = None,
           dtype=None) -> np.ndarray:
    """`steps` new tokens [B, steps] by greedy decoding with an ORT session of a cache=True export: one
    prefill (P = 0), then steps - 1 decode steps (S = 1) with each step's present fed back as past. The same
    tokens `model.generate(input_ids, max_new_tokens=steps, do_sample=False)` gives. `dtype`: of the cache
    inputs (default: what the session declares)."""
    if dtype is None:
        ort_type = next(i.type for i in session.get_inputs() if i.name.startswith("past_"))
        dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}[ort_type]
    batch = input_ids.shape[0]
    mask = np.ones_like(input_ids) if attention_mask is None else attention_mask.astype(np.int64)
    feeds = {"input_ids": input_ids.astype(np.int64), "attention_mask": mask, **_empty_past(config, batch, dtype)}
    past_names = input_names(config)[2:]
    tokens = []
    for _ in range(steps):
        logits, *present = session.run(output_names(config), feeds)
        token = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        tokens.append(token)
        feeds["input_ids"] = token
        feeds["attention_mask"] = np.concatenate([feeds["attention_mask"], np.ones_like(token)], axis=1)
        feeds.update(zip(past_names, present))
    return np.concatenate(tokens, axis=1)
