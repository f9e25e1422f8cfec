"""Models the project builds from `transformers` configs (random weights, nothing downloaded) and exports
to ONNX with either torch exporter. Used by the demo, the tests and the GPU checks."""

from __future__ import annotations

import pathlib

CONFIGS = {
    # name: (transformers config class, kwargs)
    "bert-tiny": ("BertConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=512, max_position_embeddings=128)),
    "bert-odd": ("BertConfig", dict(hidden_size=72, num_hidden_layers=3, num_attention_heads=3,
                                    intermediate_size=100, vocab_size=300, max_position_embeddings=64)),
    "bert-base": ("BertConfig", dict(vocab_size=30522)),
}
EXPORTERS = ("dynamo", "torchscript")


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
    """input_ids and a padding attention_mask (the last row padded) as torch tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def export(model, path: str | pathlib.Path, *, exporter: str = "dynamo", opset: int | None = None,
           batch: int = 2, seq: int = 16) -> pathlib.Path:
    """Export `model(input_ids, attention_mask) -> last_hidden_state` with dynamic batch and sequence."""
    import torch

    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}")
    path = pathlib.Path(path)

    class LastHidden(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    inputs = sample_inputs(model, batch, seq)
    args = (inputs["input_ids"], inputs["attention_mask"])
    wrapper = LastHidden(model).eval()
    with torch.no_grad():
        if exporter == "dynamo":
            b, s = torch.export.Dim("batch"), torch.export.Dim("seq")
            prog = torch.onnx.export(wrapper, args, input_names=["input_ids", "attention_mask"],
                                     output_names=["last_hidden_state"], dynamo=True, opset_version=opset,
                                     dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}), verbose=False)
            prog.save(str(path))
        else:
            axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                    "last_hidden_state": {0: "batch", 1: "seq"}}
            torch.onnx.export(wrapper, args, str(path), input_names=["input_ids", "attention_mask"],
                              output_names=["last_hidden_state"], dynamo=False, opset_version=opset or 17,
                              dynamic_axes=axes)
    return path
