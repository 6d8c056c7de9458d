"""Writes tiny but complete GGUF models with gguf.GGUFWriter (random blocks are valid quant data)."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFWriter

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_level_vocab() -> list[str]:
    """The 256 gpt2 byte-level symbols."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def random_blocks(rng, qtype: QT, n_rows: int, n_cols: int) -> np.ndarray:
    """uint8 (n_rows, row_nbytes) of random blocks whose f16 scales are small finite numbers (float types: small
    finite values)."""
    if qtype in (QT.F32, QT.F16, QT.BF16):
        v = (0.05 * rng.standard_normal((n_rows, n_cols))).astype(np.float32)
        if qtype == QT.BF16:
            return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return v.astype(np.float16 if qtype == QT.F16 else np.float32).view(np.uint8)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * n_cols // elems
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    scale = rng.uniform(0.002, 0.02, size=n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype in (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.IQ4_NL, QT.IQ3_XXS):
        raw[:, 0:2] = scale
    elif qtype in (QT.Q4_K, QT.Q5_K):
        raw[:, 0:2] = scale
        raw[:, 2:4] = scale
    elif qtype == QT.Q6_K:
        raw[:, -2:] = scale
    return raw.reshape(n_rows, -1)


def write_tiny_model(path, arch: str = "qwen2", qtype: QT = QT.Q8_0, n_layers: int = 2, n_embd: int = 64,
                     n_heads: int = 4, n_kv_heads: int = 2, n_ff: int = 128, seed: int = 0,
                     skip_tensor: str | None = None, tied_output: bool = False, extra_meta: dict | None = None,
                     mtp: bool = False, qtype_of: dict | None = None):
    """qtype_of: {"attn_v": QT.Q8_0, ...}: those block matrices in another type than qtype (a Q4_K_M file's
    mix). mtp: also an MTP block (loader/mtp.py's layout) after the main blocks; its tensors are drawn after
    every main tensor, so the main weights equal those of the same call without it."""
    rng = np.random.default_rng(seed)
    tokens = _byte_level_vocab() + ["he", "lo", "llo", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    token_type = [1] * (len(tokens) - 3) + [3, 3, 3]
    n_vocab = len(tokens)
    head_dim = n_embd // n_heads
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layers + (1 if mtp else 0))
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_type)
    w.add_token_merges(["h e", "l o", "l lo"])
    w.add_eos_token_id(n_vocab - 2)
    w.add_bos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for k, v in (extra_meta or {}).items():
        w.add_string(k, v) if isinstance(v, str) else w.add_uint32(k, v)

    def mat(name, n_out, n_in):
        if name != skip_tensor:
            t = (qtype_of or {}).get(name.split(".")[-2], qtype)
            w.add_tensor(name, random_blocks(rng, t, n_out, n_in), raw_dtype=t)

    def vec(name, n, around=1.0):
        if name != skip_tensor:
            w.add_tensor(name, (around + 0.1 * rng.standard_normal(n)).astype(np.float32))

    def block(i):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", n_embd)
        mat(p + "attn_q.weight", n_heads * head_dim, n_embd)
        mat(p + "attn_k.weight", n_kv_heads * head_dim, n_embd)
        mat(p + "attn_v.weight", n_kv_heads * head_dim, n_embd)
        if arch == "qwen2":
            vec(p + "attn_q.bias", n_heads * head_dim, 0.0)
            vec(p + "attn_k.bias", n_kv_heads * head_dim, 0.0)
            vec(p + "attn_v.bias", n_kv_heads * head_dim, 0.0)
        if arch == "qwen3":
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
        mat(p + "attn_output.weight", n_embd, n_heads * head_dim)
        vec(p + "ffn_norm.weight", n_embd)
        mat(p + "ffn_gate.weight", n_ff, n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        mat(p + "ffn_down.weight", n_embd, n_ff)

    mat("token_embd.weight", n_vocab, n_embd)
    for i in range(n_layers):
        block(i)
    vec("output_norm.weight", n_embd)
    if not tied_output:
        mat("output.weight", n_vocab, n_embd)
    if mtp:
        block(n_layers)
        p = f"blk.{n_layers}.nextn."
        mat(p + "eh_proj.weight", n_embd, 2 * n_embd)
        vec(p + "enorm.weight", n_embd)
        vec(p + "hnorm.weight", n_embd)
        vec(p + "shared_head_norm.weight", n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
