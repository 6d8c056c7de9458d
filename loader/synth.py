"""`strata-lite synth`: GGUF files of real model shapes filled with random but valid weights.

    synth_model(path, preset, arch=None, quant="q4_k_m", seed=0, blocks=None, progress=True, log=None)
        -> SynthReport

For tests and benchmarks where the real model is too large to bring along. Shapes come from a preset
(PRESETS), the architecture (biases, rope style) from `arch` (default: the preset's own), the tensor types
from a mix (MIXES: llama.cpp's Q4_K_M recipe, our IQ3_XXS mix of loader/quant_policy.py, or one type for
every matrix), the weights from loader/synth_blocks.py (zero-mean, std 1/sqrt(n_in): activations stay
sane through every block), the tokenizer from loader/synth_vocab.py. Tensors are generated and written
one at a time; each has its own random stream (seed, tensor name), so a tensor's bytes do not depend on
the block count or on the other tensors' types.
"""
from __future__ import annotations

import os
import re
import sys
import time
import zlib
from dataclasses import dataclass, field, replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType, GGUFValueType as VT
from tqdm import tqdm

from .atomic_file import written_whole
from .archs import ARCHITECTURES
from .quant_policy import FALLBACK, plan_types
from .synth_blocks import random_matrix, random_vector
from .synth_gguf import KV, GGUFStreamWriter
from .synth_vocab import synth_vocab


@dataclass(frozen=True)
class Preset:
    name: str
    arch: str                # the real model's architecture (the default --arch)
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_vocab: int
    rope_freq_base: float
    rms_eps: float
    n_ctx_train: int


PRESETS = {p.name: p for p in (
    Preset("qwen2.5-0.5b", "qwen2", n_layers=24, n_embd=896, n_ff=4864, n_heads=14, n_kv_heads=2, head_dim=64,
           n_vocab=151936, rope_freq_base=1e6, rms_eps=1e-6, n_ctx_train=32768),
    Preset("qwen2.5-1.5b", "qwen2", n_layers=28, n_embd=1536, n_ff=8960, n_heads=12, n_kv_heads=2, head_dim=128,
           n_vocab=151936, rope_freq_base=1e6, rms_eps=1e-6, n_ctx_train=32768),
    Preset("llama-8b-layers", "llama", n_layers=8, n_embd=4096, n_ff=14336, n_heads=32, n_kv_heads=8,
           head_dim=128, n_vocab=32000, rope_freq_base=5e5, rms_eps=1e-5, n_ctx_train=8192),
)}

# mix name -> llama.cpp `general.file_type` (enum llama_ftype). "q4_k_m", "q5_k_m" and "iq3_xxs" are mixes;
# the others put every matrix in one type ("iq3_xxs-pure": the --pure IQ3_XXS of `strata-lite quantize`;
# "q4_k" / "q5_k" are labelled llama.cpp's Q4_K_S / Q5_K_S, the nearest file types).
MIXES = {"q4_k_m": 15, "q5_k_m": 17, "iq3_xxs": 23, "f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2,
         "q5_0": 8, "iq4_nl": 25, "q4_k": 14, "q5_k": 16, "q6_k": 18, "iq3_xxs-pure": 23}
_PURE = {"f32": QType.F32, "f16": QType.F16, "bf16": QType.BF16, "q8_0": QType.Q8_0, "q4_0": QType.Q4_0,
         "q5_0": QType.Q5_0, "iq4_nl": QType.IQ4_NL, "q4_k": QType.Q4_K, "q5_k": QType.Q5_K, "q6_k": QType.Q6_K,
         "iq3_xxs-pure": QType.IQ3_XXS}
_K_M_BASE = {"q4_k_m": QType.Q4_K, "q5_k_m": QType.Q5_K}

# llama.cpp's fallbacks when a row length is not a multiple of the type's block (K-quants: 256); Q5_K falls
# back to Q5_0 here where llama.cpp takes Q5_1, a type this project does not read
_FALLBACK = {**FALLBACK, QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_0, QType.Q6_K: QType.Q8_0}

# the ChatML specials every synth vocabulary ends with: bos <|endoftext|>, eos <|im_end|>
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_PRE_TOKENIZER = {"llama": "llama-bpe"}     # tokenizer.ggml.pre per arch; others: "qwen2"

_BLK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]   # GGML order: shape[0] is the row length (n_in)
    around: float = 0.0      # 1-D tensors: values around + spread * N(0, 1)
    spread: float = 0.0


@dataclass
class SynthReport:
    path: str
    preset: Preset
    arch: str
    quant: str
    seed: int
    types: dict[str, QType] = field(default_factory=dict)   # tensor name -> type written
    by_type: dict[str, list] = field(default_factory=dict)  # type name -> [tensors, bytes]
    nbytes: int = 0                                          # file size
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"{'type':<8} {'tensors':>7} {'bytes':>15}"]
        for name, (count, nbytes) in sorted(self.by_type.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"{name:<8} {count:>7} {nbytes:>15,}")
        p = self.preset
        lines.append(f"file {self.path}: {self.nbytes:,} bytes ({self.nbytes / 2**20:,.1f} MiB), {p.name} shapes "
                     f"with {p.n_layers} blocks, arch {self.arch}, {self.quant}, seed {self.seed}, "
                     f"{self.seconds:.1f} s")
        return "\n".join(lines)


def tensor_specs(p: Preset, arch: str) -> list[TensorSpec]:
    """Every tensor of the model, in file order."""
    spec = ARCHITECTURES[arch]
    q_dim, kv_dim = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim

    def norm(name, n):
        return TensorSpec(name, (n,), around=1.0, spread=0.1)

    out = [TensorSpec("token_embd.weight", (p.n_embd, p.n_vocab))]
    for i in range(p.n_layers):
        b = f"blk.{i}."
        out += [norm(b + "attn_norm.weight", p.n_embd),
                TensorSpec(b + "attn_q.weight", (p.n_embd, q_dim)),
                TensorSpec(b + "attn_k.weight", (p.n_embd, kv_dim)),
                TensorSpec(b + "attn_v.weight", (p.n_embd, kv_dim))]
        if spec.qkv_bias:
            out += [TensorSpec(b + f"attn_{x}.bias", (n,), spread=0.02)
                    for x, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
        if spec.qk_norm:
            out += [norm(b + "attn_q_norm.weight", p.head_dim), norm(b + "attn_k_norm.weight", p.head_dim)]
        out += [TensorSpec(b + "attn_output.weight", (q_dim, p.n_embd)),
                norm(b + "ffn_norm.weight", p.n_embd),
                TensorSpec(b + "ffn_gate.weight", (p.n_embd, p.n_ff)),
                TensorSpec(b + "ffn_up.weight", (p.n_embd, p.n_ff)),
                TensorSpec(b + "ffn_down.weight", (p.n_ff, p.n_embd))]
    return out + [norm("output_norm.weight", p.n_embd), TensorSpec("output.weight", (p.n_embd, p.n_vocab))]


def _fit(qtype: QType, row_len: int) -> QType:
    while row_len % GGML_QUANT_SIZES[qtype][0]:
        qtype = _FALLBACK[qtype]
    return qtype


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _k_m_type(base: QType, name: str, row_len: int, n_layers: int) -> QType:
    """llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M (base Q4_K) or Q5_K_M (base Q5_K) for llama-style blocks
    (llama_tensor_get_type)."""
    if name == "output.weight":
        return QType.Q8_0 if row_len % 256 else QType.Q6_K
    m = _BLK.match(name)
    short = _BLK.sub("", name)
    if m and short in ("attn_v.weight", "ffn_down.weight") and _use_more_bits(int(m.group(1)), n_layers):
        return _fit(QType.Q6_K, row_len)
    return _fit(base, row_len)


def plan_mix(specs: list[TensorSpec], quant: str, n_layers: int) -> dict[str, QType]:
    """{tensor name: type}: 1-D tensors F32; matrices by the mix."""
    shapes = {s.name: s.shape for s in specs}
    if quant == "iq3_xxs":     # exactly what `strata-lite quantize --type IQ3_XXS` picks
        return {name: c.qtype for name, c in plan_types(shapes, QType.IQ3_XXS).items()}
    plan = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            plan[name] = QType.F32
        elif quant in _K_M_BASE:
            plan[name] = _k_m_type(_K_M_BASE[quant], name, shape[0], n_layers)
        else:
            plan[name] = _fit(_PURE[quant], shape[0])
    return plan


def resolve(preset, arch: str | None, quant: str, blocks: int | None) -> tuple[Preset, str]:
    """Check the arguments (ValueError with the choices); -> (preset with the block count, arch)."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r} (presets: {', '.join(PRESETS)})")
        preset = PRESETS[preset]
    arch = preset.arch if arch is None else arch
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})")
    if quant not in MIXES:
        raise ValueError(f"unknown quantization mix {quant!r} (mixes: {', '.join(MIXES)})")
    if blocks is not None:
        if blocks < 1:
            raise ValueError(f"--blocks must be at least 1, got {blocks}")
        preset = replace(preset, n_layers=int(blocks))
    return preset, arch


def metadata(p: Preset, arch: str, quant: str, seed: int) -> list[KV]:
    """The GGUF key/values: architecture numbers, file type, tokenizer, provenance (synth.*)."""
    vocab = synth_vocab(p.n_vocab, SPECIALS)
    u32, f32 = VT.UINT32, VT.FLOAT32
    a = arch + "."
    return [
        KV("general.architecture", VT.STRING, arch),
        KV("general.name", VT.STRING, f"synth-{p.name}"),
        KV("general.file_type", u32, MIXES[quant]),
        KV("general.quantization_version", u32, 2),
        KV(a + "block_count", u32, p.n_layers),
        KV(a + "context_length", u32, p.n_ctx_train),
        KV(a + "embedding_length", u32, p.n_embd),
        KV(a + "feed_forward_length", u32, p.n_ff),
        KV(a + "attention.head_count", u32, p.n_heads),
        KV(a + "attention.head_count_kv", u32, p.n_kv_heads),
        KV(a + "attention.key_length", u32, p.head_dim),
        KV(a + "attention.value_length", u32, p.head_dim),
        KV(a + "rope.dimension_count", u32, p.head_dim),
        KV(a + "rope.freq_base", f32, p.rope_freq_base),
        KV(a + "attention.layer_norm_rms_epsilon", f32, p.rms_eps),
        KV("tokenizer.ggml.model", VT.STRING, "gpt2"),
        KV("tokenizer.ggml.pre", VT.STRING, _PRE_TOKENIZER.get(arch, "qwen2")),
        KV("tokenizer.ggml.tokens", VT.ARRAY, vocab.tokens, VT.STRING),
        KV("tokenizer.ggml.token_type", VT.ARRAY, vocab.token_types, VT.INT32),
        KV("tokenizer.ggml.merges", VT.ARRAY, vocab.merges, VT.STRING),
        KV("tokenizer.ggml.bos_token_id", u32, p.n_vocab - len(SPECIALS) + SPECIALS.index("<|endoftext|>")),
        KV("tokenizer.ggml.eos_token_id", u32, p.n_vocab - len(SPECIALS) + SPECIALS.index("<|im_end|>")),
        KV("tokenizer.ggml.add_bos_token", VT.BOOL, False),
        KV("tokenizer.chat_template", VT.STRING, CHAT_TEMPLATE),
        KV("synth.preset", VT.STRING, p.name),
        KV("synth.quant", VT.STRING, quant),
        KV("synth.seed", u32, seed),
    ]


def _tensor_data(s: TensorSpec, qtype: QType, seed: int) -> np.ndarray:
    """The tensor's bytes, from its own random stream (seed, crc32 of its name)."""
    rng = np.random.default_rng([seed, zlib.crc32(s.name.encode())])
    if len(s.shape) == 1:
        return random_vector(rng, s.shape[0], s.around, s.spread)
    n_in, n_out = s.shape
    return random_matrix(rng, qtype, n_out, n_in)


def synth_model(path, preset, arch: str | None = None, quant: str = "q4_k_m", seed: int = 0,
                blocks: int | None = None, progress: bool = True, log=None) -> SynthReport:
    """Write a GGUF model to `path`. preset: a PRESETS name or a Preset; blocks: override its block
    count. Raises ValueError on bad arguments (before anything is written)."""
    t0 = time.perf_counter()
    p, arch = resolve(preset, arch, quant, blocks)
    seed = int(seed)
    if not 0 <= seed < 2**32:
        raise ValueError(f"--seed must be in 0..{2**32 - 1}, got {seed}")
    path = os.fspath(path)
    out_dir = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(out_dir):
        raise ValueError(f"{path}: directory {out_dir} does not exist")
    specs = tensor_specs(p, arch)
    plan = plan_mix(specs, quant, p.n_layers)
    report = SynthReport(path, p, arch, quant, seed, plan)
    with written_whole(path) as tmp:
        with GGUFStreamWriter(tmp, metadata(p, arch, quant, seed),
                              [(s.name, s.shape, plan[s.name]) for s in specs]) as w:
            bar = tqdm(specs, desc=f"synth {p.name} {quant}", unit="tensor", disable=not progress,
                       file=sys.stderr if log is None else log)
            for s in bar:
                data = _tensor_data(s, plan[s.name], seed)
                w.write(s.name, data)
                entry = report.by_type.setdefault(plan[s.name].name, [0, 0])
                entry[0] += 1
                entry[1] += data.nbytes
    report.nbytes = os.path.getsize(path)
    report.seconds = time.perf_counter() - t0
    return report
