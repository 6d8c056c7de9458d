"""Every CPU kernel a generation runs is loaded from Numba's on-disk cache by a later process, not compiled
again: a kernel that misses costs every process its compile time before the first token and its compiler
state in RSS (the CPU attention kernel did: its factory's closure held jitted functions, whose pickled
form, part of Numba's cache key, changes per process; so did STRATA_LITE_DECODE_BLOCK=shared's block while its
functions were closures over one another)."""
import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as QT

from tiny_model import write_tiny_model

SCRIPT = """
import sys
from strata_lite import LLM
llm = LLM(sys.argv[1], backend="cpu", n_ctx=256)
llm.generate(list(range(3, 40)), max_tokens=4)
llm.generate(list(range(3, 12)), max_tokens=3, temperature=0.8, top_k=20, seed=1)
"""


def _saved(model, block: str) -> list[str]:
    env = dict(os.environ, NUMBA_DEBUG_CACHE="1", STRATA_LITE_DECODE_BLOCK=block)
    env.pop("NUMBA_DISABLE_JIT", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], env=env, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() + out.stderr.splitlines() if "data saved" in line]


MODELS = {
    "q8_0": dict(n_embd=64, n_ff=128),
    # the int8 layouts of the K-quants and IQ3_XXS, the 4-row interleaved Q5_0 (256-weight rows at least)
    "mix": dict(n_embd=256, n_ff=512, qtype=QT.Q4_K,
                qtype_of={"attn_q": QT.Q5_0, "attn_v": QT.Q6_K, "ffn_down": QT.IQ3_XXS, "ffn_up": QT.Q5_K}),
}


@pytest.mark.parametrize("name,block", [("q8_0", "1"), ("mix", "1"), ("mix", "shared")])
def test_a_second_process_compiles_nothing(tmp_path, name, block):
    """block: STRATA_LITE_DECODE_BLOCK (1: the one-call decoder blocks, shared: one parallel region a block)."""
    model = write_tiny_model(tmp_path / f"tiny-cache-{name}.gguf", arch="qwen2", n_heads=4, n_kv_heads=2,
                             **MODELS[name])
    _saved(model, block)                 # the first process compiles what earlier tests did not
    assert _saved(model, block) == []
