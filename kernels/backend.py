"""The one interface the model code computes through; CpuBackend and CudaBackend implement it.

Placement: "device" arrays are the backend's own (numpy for the CPU, cupy for CUDA), made by `empty`,
`from_host` or another method; "host" means numpy arrays and Python numbers. The model and the engine
touch device arrays only through these methods (and `.shape` / `.reshape` of contiguous arrays), so
they never branch on the device. Sizes and scalars are always host Python ints/floats; a method that
launches device work never copies device data to the host unless its docstring says so (`to_host`,
`sample`), so a decode step can be captured into a CUDA graph and replayed.

Weight matrices come in as objects with `name`, `qtype`, `raw` (host uint8 block rows), `n_out`, `n_in`
(the loader's QuantTensor), so kernels never import the loader; `upload_weight` turns one into the
backend's device object. Index arrays (token ids, positions, page tables, rows) are validated on the
host by the caller (`Batch.validate`), so device kernels need not check them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Backend(ABC):
    name: str

    # ----------------------------------------------------------------------------- memory
    @abstractmethod
    def empty(self, shape, dtype="float32"):
        """A new uninitialized device array; shape is a host tuple of ints."""
    @abstractmethod
    def to_host(self, arr):
        """Device array -> host numpy array (synchronizes; a copy unless the device is the host)."""
    @abstractmethod
    def from_host(self, arr):
        """Host numpy array -> C-contiguous device array of the same dtype and shape."""
    @abstractmethod
    def upload_weight(self, w, vocab_rows: bool = False):
        """Host QuantTensor -> the device weight object that `embed` / `qmatmul` take. vocab_rows: its rows
        score the vocabulary (the output matrix, an MTP head), and a row must give the same bits in any
        matrix that holds it (heads cut to a draft vocabulary)."""
    @abstractmethod
    def fuse_rows(self, weights):
        """Device weights (from upload_weight) that read the same input -> one device weight holding
        their rows in order, or None when they cannot share one kernel."""
    def decode_block(self, layer, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, freq_base: float,
                     n_rot: int, neox: bool, qk_norm: bool, scale: float):
        """A callable running one decoder block (the model's _Layer `layer`, its weights from upload_weight
        / fuse_rows) on steps of at most its `max_tokens` tokens in one call, the same bits as the block's
        per-call form: block(x, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales),
        x updated in place. None (the default) where the backend has none for this block."""
        return None

    def reserve(self, max_tokens: int, max_width: int, n_heads: int, head_dim: int, max_keys: int,
                n_vocab: int, max_rows: int) -> None:
        """Size long-lived workspaces once (host ints), before the first forward: forwards of up to
        max_tokens tokens whose widest mat-mul input is max_width, attention of n_heads x head_dim over up
        to max_keys positions, sampling of up to max_rows rows of n_vocab. A later call replaces them
        (never while a captured graph uses them). The CPU needs none."""

    # ----------------------------------------------------------------------------- compute
    # Every array argument and result below is a device float32 C-contiguous array unless said
    # otherwise; results are newly allocated unless `out` (a device array of the result's shape) is given.
    @abstractmethod
    def embed(self, w, token_ids):
        """Device int32 ids (n,) -> (n, w.n_in) rows of the device embedding weight w."""
    @abstractmethod
    def qmatmul(self, w, x, out=None):
        """x (n, w.n_in) -> (n, w.n_out) = x @ W.T (activations rounded as ggml does for W's type)."""
    @abstractmethod
    def rmsnorm(self, x, weight, eps: float, out=None, round_for=None):
        """x (n, d) / sqrt(mean(x^2) + eps) * weight (d,); eps host float. round_for: a device weight
        that the result feeds next (its qmatmul* calls must come before any other rmsnorm or mat-mul
        input of the same rounding); a backend may round the result for it in the same kernel."""
    @abstractmethod
    def rope(self, x, positions, freq_base: float, n_rot: int, neox: bool, channel_scale=None) -> None:
        """In place on x (n, n_heads, head_dim): rotary embedding at device int32 positions (n,)
        (theta_i = pos * freq_base^(-2i/n_rot), i < n_rot/2; pairs (i, i + n_rot/2) when neox, else
        (2i, 2i+1); dims >= n_rot untouched), then, when channel_scale (device (n_heads, head_dim)) is
        given, every channel of every token multiplied by it. freq_base, n_rot, neox are host values."""
    def rope_qk(self, q, k, positions, freq_base: float, n_rot: int, neox: bool, q_scale=None, k_scale=None) -> None:
        """rope(q, ..., channel_scale=q_scale) and rope(k, ..., channel_scale=k_scale) of the same tokens
        (a backend may do both in one kernel)."""
        self.rope(q, positions, freq_base, n_rot, neox, channel_scale=q_scale)
        self.rope(k, positions, freq_base, n_rot, neox, channel_scale=k_scale)
    @abstractmethod
    def silu_mul(self, gate, up, out=None):
        """silu(gate) * up, both (n, d); out may be gate."""
    @abstractmethod
    def add(self, a, b, out=None):
        """a (n, d) + b, b either (n, d) or a bias vector (d,) broadcast over rows; out may be a."""
    @abstractmethod
    def take_rows(self, x, rows):
        """x (n, d), device int32 row indices (m,) -> (m, d) copy of those rows."""
    @abstractmethod
    def split_cols(self, x, widths):
        """(n, sum(widths)) -> contiguous (n, w) pieces, in order; widths host ints."""

    # Mat-mul with its neighbours, for which a backend may fuse the element-wise work into the mat-mul's
    # output (CUDA: fewer kernel launches per token); the results are the same bits as these compositions.
    def qmatmul_split(self, w, x, widths, bias=None):
        """x (n, w.n_in) -> the (n, width) column pieces of x @ W.T (+ bias (w.n_out,)), in order."""
        y = self.qmatmul(w, x)
        if bias is not None:
            self.add(y, bias, out=y)
        return self.split_cols(y, widths) if len(widths) > 1 else [y]

    def qmatmul_add(self, w, x, out) -> None:
        """out (n, w.n_out) += x @ W.T, in place (the residual add)."""
        self.add(out, self.qmatmul(w, x), out=out)

    def qmatmul_glu(self, w, x):
        """W = gate rows then up rows (fuse_rows([gate, up])): x (n, w.n_in) -> silu(gate) * up (n, w.n_out / 2)."""
        half = w.n_out // 2
        g, u = self.split_cols(self.qmatmul(w, x), (half, half))
        return self.silu_mul(g, u, out=g)

    # ----------------------------------------------------------------------------- KV cache
    # Arrays per layer, layout kv_layout.py (int8 pages + per-group float32 scales), all on the device.
    @abstractmethod
    def kv_arrays(self, n_layers: int, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int):
        """-> zeroed device (k_pages, k_scales, v_pages, v_scales) with a leading layer axis."""
    @abstractmethod
    def kv_store(self, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales) -> None:
        """Quantize k, v (n, n_kv_heads, head_dim) and store token t at sequence token_seq[t], position
        token_pos[t] (device int32 (n,)), page_tables device int32 (n_seqs, max_pages); in place on the
        layer's device pages / scales."""
    def rope_kv_store(self, q, k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                      freq_base: float, n_rot: int, neox: bool, q_scale=None, k_scale=None) -> None:
        """rope_qk(q, k, token_pos, ...) then kv_store(k, v, token_seq, token_pos, ...): this step's q and k
        rotated in place and k, v stored (a backend may do both in one kernel, with the same bits)."""
        self.rope_qk(q, k, token_pos, freq_base, n_rot, neox, q_scale, k_scale)
        self.kv_store(k, v, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales)
    @abstractmethod
    def attention(self, q, token_seq, token_pos, page_tables, k_pages, k_scales, v_pages, v_scales,
                  scale: float, out=None, max_keys: int | None = None, split_rows: int = 0, runs: tuple = ()):
        """Causal attention of q (n, n_heads, head_dim) over positions 0..token_pos[t] of sequence
        token_seq[t] (already stored); index arrays as kv_store; scale host float -> (n, n_heads, head_dim).
        max_keys: host int >= every token_pos + 1 (Batch.max_pos), sizing the launch; None = the
        reserved maximum. split_rows: host int, the first split_rows tokens are short runs of their sequences
        (decode and verify tokens: Batch.short_run_rows) that may be computed apart from the rest; runs: the
        prompt rows as host (first row, end row, sequence, keys) tuples, one sequence's consecutive tokens each,
        the rows before the first one decode and verify tokens (Batch.prompt_runs). A backend may ignore all
        three: a token's output is the same either way, except where a backend is asked to read prompt runs
        another way (the CUDA backend's f16 prompt attention, docs/cuda.md), which moves a prompt token's output
        within that path's stated bound."""

    # ----------------------------------------------------------------------------- sampling
    # Semantics: kernels/sample_rows.py. The token-count table holds, per row, how often each token
    # was generated by the request owning that row (presence / frequency penalties).
    @abstractmethod
    def sample(self, logits, rows, counts):
        """Device logits (m, n_vocab) float32 (left unchanged), host SampleRows of m rows, device counts
        table (from token_counts; may be None when every rows.count_rows is -1) -> host Sampled."""

    def argmax_prob(self, logits):
        """Device logits (m, n_vocab) -> host (ids (m,) int64: the lowest id of each row's largest logit, probs
        (m,) float64: its softmax probability): greedy drafts and their confidences. This default samples
        greedily with logprobs; a backend may give the same ids through a faster path."""
        from .sample_rows import SampleRows
        m = logits.shape[0]
        s = self.sample(logits, SampleRows.from_rows([{"n_logprobs": 0}] * m), None)
        return np.asarray(s.ids[:m], np.int64), np.exp(np.asarray(s.logprob[:m], np.float64))

    def argmax_ids(self, logits):
        """Device logits (m, n_vocab) -> device int32 (m,): argmax_prob's ids, for forwards a backend captures
        (decode_graphs: no host wait there). This default goes through argmax_prob and the host."""
        return self.from_host(self.argmax_prob(logits)[0].astype(np.int32))

    # A captured step's per-row results (strata_lite/step_results.py), for backends whose decode_graphs
    # capture steps: the greedy ids and an MTP draft head's argmax come back in one host copy.
    def step_results(self, logits, ids=None):
        """Device float32 (m, 3): column 0 the int32 bits of each row's greedy id (argmax_ids' ids; copied from
        ids, a device int32 (m,) of them, where the caller has them), columns 1-2 zero until draft_results
        fills them. One launch, no host wait."""
        raise NotImplementedError(f"{type(self).__name__} captures no steps")

    def draft_results(self, logits, res) -> None:
        """Columns 1-2 of step_results' res <- each row's argmax column of logits (a draft head's) as int32
        bits and its softmax probability (argmax_prob's values). One launch, no host wait."""
        raise NotImplementedError(f"{type(self).__name__} captures no steps")

    @abstractmethod
    def token_counts(self, n_rows: int, n_vocab: int):
        """-> device int32 (n_rows, n_vocab) table of zeros."""
    @abstractmethod
    def add_counts(self, counts, count_rows, ids) -> None:
        """counts[count_rows[i], ids[i]] += 1 for every i with count_rows[i] >= 0 (repeats add up);
        count_rows and ids are host int32 (m,)."""
    @abstractmethod
    def reset_counts(self, counts, row: int) -> None:
        """Zero one row (host int) of the device table."""

    # ----------------------------------------------------------------------------- optional services
    # A backend without them returns None and the engine uses its generic path.
    uses_scratch_page = False   # True: decode_graphs wants one KV page of its own for padded rows
    queues_work = False         # True: a forward returns once its work is queued on the device (the engine
                                # hands out the previous step's tokens while it runs)

    def kv_copier(self, dev_arrays, host_arrays):
        """A KVCopier (strata_lite/host_pool.py) between the device KV arrays (k_pages, k_scales, v_pages,
        v_scales) and the host pool's numpy arrays of the same layout, or None for the generic one."""
        return None

    def decode_graphs(self, forward, max_pages: int, max_keys: int, scratch_page: int, logits: bool = True,
                      row_inputs: tuple = (), max_seqs: int = 1, max_tokens: int = 16):
        """Captured decode steps (kernels/cuda/graphs.py: accepts(batch), run(batch, *inputs) -> device
        logits) for forward(batch, *inputs) -> device logits (or a tuple of per-token arrays; logits=False: a
        forward of batches without logit rows; row_inputs: widths of per-token float32 inputs beside the
        batch; max_seqs / max_tokens: the sequences and tokens a step of the caller may have, which bound the
        token counts captured), or None where the backend does not capture."""
        return None

    def synchronize(self) -> None:
        """Wait for all queued device work; a device fault surfaces here."""

    def is_fault(self, exc: BaseException) -> bool:
        """True when exc came from the device itself (not from bad input) and the device state can no longer
        be trusted: the engine then fails every request and stops."""
        return False

    def describe(self) -> str:
        """One line for the start-up log: the backend and the device it runs on."""
        return self.name + (f" ({self.auto_reason})" if getattr(self, "auto_reason", None) else "")
