"""Greedy generation with a decoder exported with its KV cache, on ONNX Runtime, with and without ort_triton.

    python examples/generate.py --model llama-tiny --steps 16                 # CPU: stock ORT vs torch
    python examples/generate.py --model llama-tiny --steps 16 --optimize      # + the rewritten model (CPU:
                                                                              #   through its function bodies)
    python examples/generate.py --model llama-1b --cuda --optimize --float16  # GPU: the library's kernels, the
                                                                              #   module exported in fp16

The model comes from a transformers config with random weights (ort_triton/decoders.py) and is exported
with one of the torch exporters: inputs input_ids, attention_mask, past_key_i/past_value_i; outputs logits
and present_key_i/present_value_i. One prefill (past length 0), then one decode step per token, each
step's present fed back as the next step's past.

On CUDA the loop uses IO binding: every cache tensor has two device buffers of the final length; a step
reads its past from one and writes its present into the other (no allocation, no copy to the host but the
logits). With `--kv-cache seq-major` the rewritten model's cache is laid out [T, B, Nkv, D] (graph_rewrites/
kv_layout.py) and each cache tensor has one buffer: past and present are bound to it, past as its first P rows and
present as its first P + S, so a step writes only its new rows and copies nothing. On CPU it calls session.run
(`--io-binding`, or `--kv-cache seq-major`, runs the CUDA loop's code on CPU buffers instead).
Prints the tokens of each runtime and whether they are identical; exits 1 when stock ORT and ort_triton
disagree. With torch's fp32 tokens (without --no-torch) and the IO-binding loop, each ORT runtime is also held
against fp32: how long its greedy tokens stay fp32's, and how often, fed fp32's tokens, it predicts fp32's next one.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort

from ort_triton import decoders
from ort_triton.ops.kv_layout import session_seq_major_names


def greedy_io_binding(session, config, input_ids: np.ndarray, steps: int, attention_mask=None,
                      device: str = "cuda", device_id: int = 0, forced: np.ndarray | None = None,
                      record: list | None = None, seq_major: bool | None = None) -> np.ndarray:
    """`decoders.greedy` with preallocated cache buffers bound through IO binding (see the module doc).
    forced [B, steps]: feed these tokens instead of the argmax (teacher forcing); record: gets each step's
    last-position logits (float32 [B, vocab]); seq_major: the model's cache is [T, B, Nkv, D], one buffer a tensor
    that each present is bound over its past in; None: each cache tensor as the model's metadata says
    (`ort-triton optimize --kv-cache seq-major` names the tensors it relaid)."""
    layers, kv, head_dim = decoders.cache_spec(config)
    past_names, present_names = decoders.input_names(config)[2:], decoders.output_names(config)[1:]
    relaid = session_seq_major_names(session)
    seq = [(p in relaid and q in relaid) if seq_major is None else seq_major for p, q in zip(past_names, present_names)]
    ort_type = next(i.type for i in session.get_inputs() if i.name == past_names[0])
    dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}[ort_type]
    batch, prompt = input_ids.shape
    capacity = batch * kv * (prompt + steps) * head_dim  # elements of the longest present
    # heads first, two ping-pong buffers per cache tensor: [B, kv, P, D] contiguous is a prefix of the buffer for
    # every P; sequence first, one: [P, B, kv, D] is the first P rows of [P + S, B, kv, D], so present holds past
    buffers = [[ort.OrtValue.ortvalue_from_shape_and_type([capacity], dtype, device, device_id)
                for _ in range(1 if s else 2)] for s in seq]

    def shape(t, s):
        return [t, batch, kv, head_dim] if s else [batch, kv, t, head_dim]

    ids = np.ascontiguousarray(input_ids, dtype=np.int64)
    mask = np.ones_like(ids) if attention_mask is None else np.ascontiguousarray(attention_mask, dtype=np.int64)
    binding = session.io_binding()
    past, tokens = 0, []
    for step in range(steps):
        total = past + ids.shape[1]
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        binding.bind_output("logits", device, device_id)  # ORT allocates it: its length changes after prefill
        for i, (p, q) in enumerate(zip(past_names, present_names)):
            read, write = (0, 0) if seq[i] else (step % 2, 1 - step % 2)
            binding.bind_input(p, device, device_id, dtype, shape(past, seq[i]), buffers[i][read].data_ptr())
            binding.bind_output(q, device, device_id, dtype, shape(total, seq[i]), buffers[i][write].data_ptr())
        session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()  # outputs in binding order: logits first
        token = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        tokens.append(token)
        if record is not None:
            record.append(logits[:, -1].astype(np.float32))
        if forced is not None:
            token = np.ascontiguousarray(forced[:, step:step + 1], dtype=np.int64)
        ids, past = token, total
        mask = np.concatenate([mask, np.ones_like(token)], axis=1)
    return np.concatenate(tokens, axis=1)


def near_ties(ref_session, session, config, ids, mask, tokens, device) -> bool:
    """Both sessions fed the reference's tokens (teacher forcing): at each step where their argmax differs,
    print the reference's top-2 margin and the largest logit difference of the step. True when every
    disagreement is a near-tie (margin below that difference): rounding, not a wrong result."""
    ref, ours = [], []
    greedy_io_binding(ref_session, config, ids, tokens.shape[1], mask, device=device, forced=tokens, record=ref)
    greedy_io_binding(session, config, ids, tokens.shape[1], mask, device=device, forced=tokens, record=ours)
    diffs = [float(np.abs(a - b).max()) for a, b in zip(ref, ours)]
    ties = True
    for step, (a, b, diff) in enumerate(zip(ref, ours, diffs)):
        for row in np.flatnonzero(a.argmax(-1) != b.argmax(-1)):
            top2 = np.sort(a[row])[-2:]
            margin = float(top2[1] - top2[0])
            ties &= margin < diff
            print(f"    step {step} row {row}: argmax {a[row].argmax()} (reference) vs {b[row].argmax()}; reference "
                  f"top-2 margin {margin:.4f}, largest |logit difference| of the step {diff:.4f}")
    print(f"teacher-forced along the reference's tokens: largest |logit difference| "
          f"{max(diffs):.4f} (largest |logit| "
          f"{max(float(np.abs(a).max()) for a in ref):.2f}); every disagreement a near-tie: {ties}")
    return ties


def against_fp32(sessions, config, ids, mask, want, device) -> None:
    """Each session against torch's fp32 tokens `want` [B, steps]: the steps its free-running greedy tokens stay
    identical to fp32's (per row), and, fed fp32's tokens (teacher forcing), how many of its next-token argmaxes
    are fp32's. Random-weight models have near-ties that fp16 rounding breaks either way; this says whether
    ort_triton's kernels break them more often than stock ORT's."""
    steps = want.shape[1]
    for label, (session, tokens) in sessions.items():
        same = [int(np.argmax(row != ref)) if (row != ref).any() else steps for row, ref in zip(tokens, want)]
        forced = greedy_io_binding(session, config, ids, steps, mask, device=device, forced=want)
        agree = int((forced == want).sum())
        print(f"{label} against torch (fp32): identical for the first {same} steps of each row; teacher-forced "
              f"along fp32's tokens, next-token argmax equal to fp32's at {agree} of {want.size} steps")


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-tiny", choices=sorted(decoders.CONFIGS))
    ap.add_argument("--steps", type=int, default=16, help="tokens to generate")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=8, help="prompt length (the last row is left-padded by 2)")
    ap.add_argument("--exporter", default="dynamo", choices=decoders.EXPORTERS)
    ap.add_argument("--opset", type=int, default=None, help="e.g. 23: ONNX Attention/RMSNormalization/RotaryEmbedding")
    ap.add_argument("--optimize", action="store_true", help="also run the model rewritten by graph_rewrites.optimize")
    ap.add_argument("--cuda", action="store_true", help="CUDA EP with IO binding; the rewritten model gets the "
                                                        "ort_triton library (ort_triton.make_session)")
    ap.add_argument("--float16", action="store_true", help="export the model in fp16 (the cache too); both "
                                                            "runtimes run that export")
    ap.add_argument("--convert-float16", action="store_true",
                    help="instead: export in fp32 and convert each model with graph_rewrites.to_float16 (what "
                         "`ort-triton optimize --float16` does)")
    ap.add_argument("--io-binding", action="store_true", help="on CPU: use the IO-binding loop too")
    ap.add_argument("--kv-cache", choices=("heads-first", "seq-major"), default="heads-first",
                    help="with --optimize: the rewritten model's cache layout (seq-major: present bound over past, "
                         "no copy a step; the IO-binding loop runs it, on CPU too)")
    ap.add_argument("--out-dir", type=pathlib.Path, default=None, help="where the .onnx files go (default: temp)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's generate (big models)")
    args = ap.parse_args(argv)

    import torch

    import graph_rewrites
    from ort_triton.cli import save_atomic

    out_dir = args.out_dir or pathlib.Path(tempfile.mkdtemp(prefix="ot_generate_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.float16 and args.convert_float16:
        ap.error("give --float16 or --convert-float16, not both")
    model = decoders.build(args.model)
    # --float16 exports the module in fp16, as a user serving fp16 does (HF's RMSNorm casts to fp32 inside, and
    # the export keeps those casts). Converting the fp32 export instead (--convert-float16) left stock ORT
    # emitting token 0 at every step of the random-weight Llama-1B on the H200 (session 13), a sign of
    # non-finite logits; the likely cause, not yet confirmed, is the unfused RMSNorm's x^2 overflowing fp16.
    exported = copy.deepcopy(model).half() if args.float16 else model
    path = out_dir / f"{args.model}-{args.exporter}{'-float16' * args.float16}.onnx"
    _, secs = timed(decoders.export, exported, path, exporter=args.exporter, opset=args.opset)
    del exported
    print(f"exported {args.model} ({args.exporter}, opset {args.opset or 'default'}{', float16' * args.float16}) "
          f"to {path} in {secs:.1f} s")

    rng = np.random.default_rng(0)
    ids = rng.integers(1, model.config.vocab_size, (args.batch, args.prompt), dtype=np.int64)
    mask = np.ones_like(ids)
    if args.batch > 1 and args.prompt > 2:
        mask[-1, :2] = 0  # a batched prompt is left-padded

    # Every variant is a file: a 1B model in fp16 is past protobuf's 2 GiB, so it cannot go to ORT as bytes
    # (save_atomic moves the weights of such a model to a data file beside it).
    stock = path
    if args.convert_float16:
        stock = out_dir / f"{path.stem}.float16.onnx"
        save_atomic(graph_rewrites.to_float16(onnx.load(path)), stock)
    variants = {"ORT": str(stock)}
    if args.optimize:
        optimized, report = graph_rewrites.optimize(str(path), report=True, float16=args.convert_float16,
                                                    kv_cache=args.kv_cache)
        for note in report.notes:
            print(f"note: {note}")
        fused = {k: v for k, v in report.ops_after.items() if k.startswith("ai.ort_triton.")}
        print(f"ort_triton fused: {fused or 'nothing'}")
        ours = out_dir / f"{path.stem}.ort_triton{'.float16' * args.convert_float16}.onnx"
        save_atomic(optimized, ours)
        variants["ORT + ort_triton"] = str(ours)

    results = {}
    if not args.no_torch:
        with torch.no_grad():
            want, secs = timed(model.generate, torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               max_new_tokens=args.steps, do_sample=False)
        results["torch (fp32)"] = want[:, ids.shape[1]:].numpy(), secs
    device = "cuda" if args.cuda else "cpu"
    seq_major = args.optimize and args.kv_cache == "seq-major"  # decoders.greedy feeds a cache heads first
    io_binding = args.cuda or args.io_binding or seq_major  # one loop for every runtime, to compare alike
    sessions = {}
    for label, onnx_model in variants.items():
        if args.cuda:
            import ort_triton

            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
            if label == "ORT":  # stock: no library registered
                session = ort.InferenceSession(onnx_model, providers=providers)
            else:
                session = ort_triton.make_session(onnx_model, providers=providers)
        else:
            session = ort.InferenceSession(onnx_model, providers=["CPUExecutionProvider"])
        sessions[label] = session
        if io_binding:
            greedy_io_binding(session, model.config, ids, 2, mask, device=device)  # warm-up
            tokens, secs = timed(greedy_io_binding, session, model.config, ids, args.steps, mask, device=device)
        else:
            tokens, secs = timed(decoders.greedy, session, model.config, ids, args.steps, attention_mask=mask)
        results[label] = tokens, secs

    for label, (tokens, secs) in results.items():
        print(f"{label:18s} {1e3 * secs / args.steps:8.2f} ms/token")
        for row in tokens:
            print(f"    {' '.join(map(str, row))}")
    if "torch (fp32)" in results and io_binding:
        against_fp32({label: (sessions[label], results[label][0]) for label in variants}, model.config, ids, mask,
                     results["torch (fp32)"][0], device)
    ref_label = "ORT"
    ok = True
    for label, (tokens, _) in results.items():
        if label != ref_label:
            same = np.array_equal(tokens, results[ref_label][0])
            print(f"{label} identical to {ref_label}: {same}")
            if label == "ORT + ort_triton":
                ok &= same
                if not same and io_binding:  # why: a wrong kernel, or fp16 rounding at a tie?
                    near_ties(sessions[ref_label], sessions[label], model.config, ids, mask,
                              results[ref_label][0], device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
