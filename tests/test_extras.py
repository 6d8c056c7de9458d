"""Every pip extra has a name that is already in normalized form (PEP 685: lowercase letters, digits and
single '-'), so every pip, including pip 23 that looks the requested name up without normalizing it,
finds it; and every install command in the README, docs and error messages names an extra the installed
metadata provides."""
import configparser
import importlib.metadata
import re
from pathlib import Path

from strata_lite.loader.known_models import KNOWN_MODELS, install_command

ROOT = Path(__file__).resolve().parents[1]
NORMALIZED = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
# `.[a,b]` / `strata_lite[a]` in install commands
EXTRAS_IN_TEXT = re.compile(r"(?:\.|strata[-_]lite)\[([A-Za-z0-9_.,\- ]+)\]")


def _setup_cfg_extras() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return set(cfg["options.extras_require"])


def _metadata_extras() -> set[str]:
    return set(importlib.metadata.metadata("strata_lite").get_all("Provides-Extra") or [])


def test_extra_names_are_normalized():
    names = _setup_cfg_extras()
    assert names, "no extras in setup.cfg"
    bad = sorted(n for n in names if not NORMALIZED.fullmatch(n))
    assert not bad, f"extras not in normalized form (pip 23 cannot find them): {bad}"


def test_installed_metadata_provides_the_same_extras():
    assert _metadata_extras() == _setup_cfg_extras(), "reinstall (pip install -e .) after changing extras"


def _documents():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield from sorted((ROOT / "perf").glob("*.py"))
    yield from sorted(ROOT.glob("*/**/*.py"))


def test_install_commands_name_provided_extras():
    provided, wrong = _metadata_extras(), []
    for path in _documents():
        if "tests" in path.relative_to(ROOT).parts:
            continue
        for m in EXTRAS_IN_TEXT.finditer(path.read_text(encoding="utf-8", errors="replace")):
            wrong += [f"{path.relative_to(ROOT)}: {m.group(0)}" for e in m.group(1).split(",")
                      if e.strip() not in provided]
    assert not wrong, f"install commands naming extras the metadata does not provide: {wrong}"


def test_error_messages_name_provided_extras():
    from strata_lite.kernels import cuda_unavailable_reason
    texts = [install_command(m) for m in KNOWN_MODELS.values()]
    texts += [install_command(m, force=True) for m in KNOWN_MODELS.values()]
    why = cuda_unavailable_reason()
    if why is not None:                    # the message that says how to get the CUDA backend
        texts.append(why)
    provided = _metadata_extras()
    found = [e.strip() for t in texts for m in EXTRAS_IN_TEXT.finditer(t) for e in m.group(1).split(",")]
    assert found, "the install messages name no extras"
    assert set(found) <= provided, sorted(set(found) - provided)
