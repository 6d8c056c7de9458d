"""Where `train-mtp` runs and how large a run is when the command line does not say: the training device
picked from --device and --backend, and each device's defaults (docs/mtp_training.md gives the reasons).
Light to import: the command line builds its help from DEFAULTS."""
from __future__ import annotations

from dataclasses import dataclass

from .kernels import cuda_unavailable_reason
from .mtp_train_prompts import prompts


@dataclass(frozen=True)
class RunDefaults:
    steps: int
    batch: int               # windows per step
    ctx: int                 # window length in tokens
    train_tokens: int        # tokens of text files the model is run over
    eval_tokens: int         # held-out tokens of text files
    lr: float                # peak Adam learning rate
    answers: int             # prompts whose greedy answers are added to the text (mtp_train_prompts)
    answer_tokens: int       # longest answer
    tf32: bool               # float32 mat-muls on the TF32 tensor cores (GPU only)


# cpu: the sizes of a run of a few hours on a small machine. cuda: the run that trained the shipped head of
# the default model on an H200 in 320 s (docs/mtp_training.md, "Run size on the GPU"; in plain float32 then,
# TF32 mat-muls since: 1.9x the float32 step on an H100, the same loss).
DEFAULTS = {
    "cpu": RunDefaults(steps=300, batch=2, ctx=256, train_tokens=65536, eval_tokens=8192, lr=3e-4, answers=0,
                       answer_tokens=512, tf32=False),
    "cuda": RunDefaults(steps=700, batch=16, ctx=512, train_tokens=2_000_000, eval_tokens=65536, lr=1e-3,
                        answers=len(prompts()), answer_tokens=384, tf32=True),
}


# tokens in a trained block's draft vocabulary (mtp_vocab.py): the head reads 32768 / 151936 = 22% of its
# rows for Qwen2.5; 32768 of the stdlib's most frequent tokens hold 99.x% of held-out code (docs/mtp_training.md)
DRAFT_VOCAB = 32768

# The depth-2 loss's weight (docs/mtp_training.md, "Depth 2"): a second draft is verified only when the
# first was accepted (about 0.7 of the time for the default model's head), so its rows count for at most
# that; below it, since the first draft is also drafted alone (--spec mtp:1, auto's one-token drafts) and
# must not lose to the second, whose harder rows give the larger loss and gradients.
CHAIN_WEIGHT = 0.5

# The deepest chained draft trained (docs/mtp_training.md, "Chained drafts"): pass D's loss counts
# CHAIN_WEIGHT^(D-1), as its draft is verified only when the D - 1 before it were accepted.
CHAIN_DEPTH = 2

# The feature term's weight (docs/mtp_training.md, "The feature term"): each pass's block output is also
# pulled towards the model's own last hidden state one position further, which is what the next chained
# pass reads in its place.
FEATURE_WEIGHT = 0.0


def resolve_device(device: str, backend: str) -> tuple[str, str]:
    """(--device, --backend) -> (the device of the training math, the engine backend of the model's pass).
    device "auto": cuda when the engine runs on CUDA (backend cuda, or auto with a GPU CuPy can use), else
    cpu. device cuda with backend auto puts the model's pass on CUDA too; any other pair is taken as given."""
    if device == "auto":
        device = "cuda" if backend == "cuda" or (backend == "auto" and cuda_unavailable_reason() is None) else "cpu"
    if device == "cuda" and backend == "auto":
        backend = "cuda"
    return device, backend


def default_help(name: str) -> str:
    """'(cpu: X, cuda: Y)' for an option's help."""
    return "(cpu: {}, cuda: {})".format(*(getattr(DEFAULTS[d], name) for d in ("cpu", "cuda")))
