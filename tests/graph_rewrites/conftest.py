"""Fixtures the decoder rule tests share."""

import pytest


@pytest.fixture(scope="module")
def decoder_exports(tmp_path_factory):
    """get(name, exporter, impl="sdpa", cache=True, opset=None) -> (module, path): decoders built and exported once
    per test module."""
    from ort_triton import decoders

    built, paths = {}, {}

    def get(name, exporter, impl="sdpa", cache=True, opset=None):
        if (name, impl) not in built:
            built[name, impl] = decoders.build(name, attn_implementation=impl)
        key = (name, exporter, impl, cache, opset)
        if key not in paths:
            out = tmp_path_factory.mktemp("-".join(map(str, key))) / "m.onnx"
            paths[key] = decoders.export(built[name, impl], out, exporter=exporter, cache=cache, opset=opset)
        return built[name, impl], paths[key]

    return get
