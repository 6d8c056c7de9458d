"""Start a CPU Engine on a tiny model with the speculative-decoding settings the engine tests share."""
from strata_lite.config import EngineConfig
from strata_lite.engine import Engine


def start_engine(model_path, spec, n_ctx: int, **kw) -> Engine:
    """A started, ready Engine: 3 slots, 16-token steps and pages, a small host tier; kw override."""
    cfg = dict(model=model_path, backend="cpu", n_ctx=n_ctx, parallel=3, step_tokens=16, page_size=16,
               host_kv_gib=0.01, max_queue=64, spec=spec)
    cfg.update(kw)
    eng = Engine(EngineConfig(**cfg))
    eng.start()
    assert eng.wait_ready(120)
    return eng
