"""`ort-triton export-server`: the Triton model repository. The server cannot run on these machines, so the
test parses config.pbtxt with Triton's own ModelConfig message (tritonclient's model_config_pb2, protobuf
text format), checks what it says against the model, and checks that every file it references exists."""

import pathlib

import onnx
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import graph_rewrites
from ort_triton import models
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv")
    src = models.export(models.build("bert-tiny"), d / "bert.onnx")
    onnx.save(graph_rewrites.optimize(str(src)), str(d / "bert.ot.onnx"))
    run_cli("optimize", src, "-o", d / "bert.static.onnx", "--static-shapes", "input_ids=1x16,attention_mask=1x16")
    return d


def _parse(path: pathlib.Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_batched_repository(optimized, native_library, tmp_path):
    res = run_cli("export-server", optimized / "bert.ot.onnx", "--out", tmp_path / "repo", "--library", native_library,
                  "--max-batch-size", "16")
    model_dir = tmp_path / "repo" / "bert"
    assert "wrote" in res.stdout
    cfg = _parse(model_dir / "config.pbtxt")
    assert cfg.name == "bert" and cfg.platform == "onnxruntime_onnx" and cfg.max_batch_size == 16
    assert cfg.HasField("dynamic_batching")
    assert [(i.name, model_config_pb2.DataType.Name(i.data_type), list(i.dims)) for i in cfg.input] == [
        ("input_ids", "TYPE_INT64", [-1]), ("attention_mask", "TYPE_INT64", [-1])]
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("last_hidden_state", [-1, 64])]
    (lib,) = cfg.model_operations.op_library_filename
    assert pathlib.Path(lib).is_absolute() and pathlib.Path(lib).is_file()
    assert pathlib.Path(lib).read_bytes() == pathlib.Path(native_library).read_bytes()
    model = onnx.load(str(model_dir / "1" / "model.onnx"))
    assert any(n.domain == "ai.ort_triton" for n in model.graph.node)
    assert not list(tmp_path.glob("repo/.bert.*")), "temporary directory left behind"


def test_cuda_graph_repository_needs_static_shapes(optimized, native_library, tmp_path):
    run_cli("export-server", optimized / "bert.static.onnx", "--out", tmp_path / "repo", "--library", native_library,
            "--cuda-graph", "--server-repo", "/models", "--name", "bert_cg")
    cfg = _parse(tmp_path / "repo" / "bert_cg" / "config.pbtxt")
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")
    assert [list(i.dims) for i in cfg.input] == [[1, 16], [1, 16]]
    assert list(cfg.model_operations.op_library_filename) == ["/models/bert_cg/libort_triton.so"]
    (acc,) = cfg.optimization.execution_accelerators.gpu_execution_accelerator
    assert acc.name == "cuda" and acc.parameters["enable_cuda_graph"] == "1"
    assert (tmp_path / "repo" / "bert_cg" / "libort_triton.so").is_file()

    res = run_cli("export-server", optimized / "bert.ot.onnx", "--out", tmp_path / "repo2", "--library",
                  native_library, "--cuda-graph", check=False)
    assert res.returncode == 2 and "needs static input shapes" in res.stderr and "--static-shapes" in res.stderr
    assert not (tmp_path / "repo2" / "bert").exists()


def test_existing_model_dir_and_missing_library_are_clear_errors(optimized, native_library, tmp_path):
    args = ["export-server", optimized / "bert.ot.onnx", "--out", tmp_path / "repo", "--library"]
    run_cli(*args, native_library)
    res = run_cli(*args, native_library, check=False)
    assert res.returncode == 2 and "exists; pass --force" in res.stderr
    run_cli(*args, native_library, "--force")
    res = run_cli(*args, tmp_path / "nope.so", "--name", "other", check=False)
    assert res.returncode == 2 and "nope.so not found" in res.stderr
    assert not (tmp_path / "repo" / "other").exists()
