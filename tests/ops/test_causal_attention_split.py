"""split_keys, the decode split's chunking (ops/causal_attention.py; native/causal_attention.c computes it again,
tests/native checks the two agree): chunks of whole key blocks, never under the minimum, and never more programs
than the target, so a target of whole waves never starts a partial one."""
from hypothesis import given
from hypothesis import strategies as st

from ort_triton.ops.causal_attention import SPLIT_TARGET, block_config, split_chunks, split_keys


@given(t=st.integers(0, 1 << 17), programs=st.integers(1, 4096), block_n=st.sampled_from([16, 32, 64, 128]),
       target=st.integers(-1, 2048), min_keys=st.integers(0, 1024))
def test_a_split_stays_under_the_target(t, programs, block_n, target, min_keys):
    chunk = split_keys(t, programs, block_n, target, min_keys)
    if not chunk:  # one pass: two chunks a program would pass the target, or the cache is short
        assert target // programs < 2 or t <= max(-(-min_keys // block_n) * block_n, 2 * block_n + 1)
        return
    chunks = split_chunks(t, chunk)
    assert chunk % block_n == 0 and chunk >= min_keys and 2 <= chunks
    assert programs * chunks <= target


def test_waves_at_the_models_heads():
    """One wave for the narrow spec, two for the wide (fp16, head dim 64): Llama-1B's 8 KV heads and GPT-2's 12
    at batch 1, 8 and 16 over a cache of 4097 keys."""
    got = {}
    for nkv in (8, 12):
        for b in (1, 8, 16):
            cfg = block_config(64, "float16", 1, b * nkv)
            chunk = split_keys(4097, b * nkv, cfg["BLOCK_N"], cfg["SPLIT_TARGET"])
            got[b * nkv] = split_chunks(4097, chunk)
    assert got == {8: 11, 64: 4, 128: 2, 12: 11, 96: 2, 192: 1}
    assert SPLIT_TARGET == 132
