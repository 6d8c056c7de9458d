"""pytest hooks of the perf/ suites: after the run, one table of every benchmark's extra_info (the per-call µs,
GB/s, TFLOP/s, fraction of the copy bandwidth and reference figures the suites record there), since
pytest-benchmark's own table has only the times of its rounds."""
import pytest

_ROWS = pytest.StashKey[list]()


def extra_info_table(rows: list[tuple[str, dict]]) -> str:
    """rows of (benchmark name, extra_info) -> a plain-text table: one column per key, in order of first
    appearance; a missing or None value shows as '-'."""
    keys = list(dict.fromkeys(k for _, info in rows for k in info))
    cells = [["benchmark", *keys]] + [[name, *("-" if info.get(k) is None else f"{info[k]:,}"
                                               if isinstance(info[k], (int, float)) else str(info[k])
                                               for k in keys)] for name, info in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield
    bench = getattr(item, "funcargs", {}).get("benchmark")
    info = getattr(bench, "extra_info", None)
    if info:
        item.config.stash.setdefault(_ROWS, []).append((item.name, dict(info)))


def pytest_terminal_summary(terminalreporter, config):
    rows = config.stash.get(_ROWS, [])
    if rows:
        terminalreporter.section("per-call figures (extra_info)")
        terminalreporter.write_line(extra_info_table(rows))
