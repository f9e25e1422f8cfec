"""Models the project builds from `transformers` configs (random weights, nothing downloaded) and exports
to ONNX with either torch exporter. Used by the demo, the tests and the GPU checks.

Text encoders are exported as (input_ids, attention_mask) -> last_hidden_state, vision ones as
pixel_values -> last_hidden_state; batch and sequence length stay dynamic.
"""

from __future__ import annotations

import pathlib

CONFIGS = {
    # name: (transformers config class, kwargs). Head dims: the kernel takes 32, 40, 64, 80, 96, 128.
    "bert-tiny": ("BertConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, vocab_size=512, max_position_embeddings=128)),
    "bert-40": ("BertConfig", dict(hidden_size=120, num_hidden_layers=3, num_attention_heads=3,
                                   intermediate_size=250, vocab_size=300, max_position_embeddings=64)),
    "bert-odd": ("BertConfig", dict(hidden_size=72, num_hidden_layers=3, num_attention_heads=3,  # head dim 24
                                    intermediate_size=100, vocab_size=300, max_position_embeddings=64)),
    "roberta-tiny": ("RobertaConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=128, vocab_size=512, max_position_embeddings=130)),
    "distilbert-tiny": ("DistilBertConfig", dict(dim=64, n_layers=2, n_heads=2, hidden_dim=128, vocab_size=512,
                                                 max_position_embeddings=128)),
    "vit-tiny": ("ViTConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=128, image_size=32, patch_size=8)),
    "bert-base": ("BertConfig", dict(vocab_size=30522, max_position_embeddings=2048)),  # 8 x 2048 is a bench shape
}
EXPORTERS = ("dynamo", "torchscript")


def is_vision(model) -> bool:
    return model.config.model_type == "vit"


def build(name: str, *, attn_implementation: str = "sdpa", seed: int = 0):
    """An eval-mode transformers model with random weights for one of CONFIGS."""
    import torch
    import transformers

    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}")
    cls_name, kwargs = CONFIGS[name]
    config = getattr(transformers, cls_name)(**kwargs, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config).eval()
    # Perturb every parameter: fresh LayerNorm weights are all ones and biases all zeros, which the dynamo
    # exporter deduplicates into one initializer and which would hide a rewrite that swaps them.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def sample_inputs(model, batch: int = 2, seq: int = 16, seed: int = 0) -> dict:
    """Inputs by name as torch tensors: token ids and a padding mask (the last row padded), or pixels."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if is_vision(model):
        size = model.config.image_size
        return {"pixel_values": torch.randn(batch, model.config.num_channels, size, size, generator=g)}
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def export(model, path: str | pathlib.Path, *, exporter: str = "dynamo", opset: int | None = None,
           batch: int = 2, seq: int = 16) -> pathlib.Path:
    """Export `model(**inputs) -> last_hidden_state` with dynamic batch (and sequence, for text)."""
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}")
    path = pathlib.Path(path)
    inputs = sample_inputs(model, batch, seq)
    names = list(inputs)

    class Text(torch.nn.Module):  # explicit arguments: torch.export names inputs after them
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    class Vision(Text):
        def forward(self, pixel_values):
            return self.inner(pixel_values=pixel_values).last_hidden_state

    wrapper = (Vision if is_vision(model) else Text)(model).eval()
    args = tuple(inputs.values())
    dyn_axes = {0: "batch"} if is_vision(model) else {0: "batch", 1: "seq"}
    with torch.no_grad():
        if exporter == "dynamo":
            dims = {k: torch.export.Dim(v) for k, v in dyn_axes.items()}
            prog = torch.onnx.export(wrapper, args, input_names=names, output_names=["last_hidden_state"],
                                     dynamo=True, opset_version=opset,
                                     dynamic_shapes=tuple(dims for _ in names), verbose=False)
            prog.save(str(path))
        else:
            axes = {n: dyn_axes for n in names} | {"last_hidden_state": {0: "batch", 1: "seq"}}
            torch.onnx.export(wrapper, args, str(path), input_names=names, output_names=["last_hidden_state"],
                              dynamo=False, opset_version=opset or 17, dynamic_axes=axes)
    return path
