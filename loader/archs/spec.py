from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    name: str
    rope_neox: bool          # NEOX rope rotates (i, i + n_rot/2); "normal" rotates (2i, 2i+1)
    qkv_bias: bool           # attn_q/k/v carry a bias vector
    qk_norm: bool            # per-head RMSNorm of q and k before rope (attn_q_norm / attn_k_norm)
    default_rope_base: float = 10000.0
