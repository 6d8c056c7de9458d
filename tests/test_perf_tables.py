"""perf/conftest.py: the table of the benchmarks' extra_info printed after a perf/ suite."""
import os

pytest_plugins = ["pytester"]

CONFTEST = os.path.join(os.path.dirname(__file__), "..", "perf", "conftest.py")


def test_benchmarks_extra_info_is_printed_as_one_table(pytester):
    with open(CONFTEST) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(test_fake_bench="""
        import pytest

        @pytest.mark.parametrize("n", [1, 8])
        def test_matvec(benchmark, n):
            benchmark.pedantic(lambda: None, rounds=2)
            benchmark.extra_info.update({"us": 12.5 * n, "GB/s": 3270 // n, "llama.cpp us": None if n > 1 else 22.9})

        def test_without_info(benchmark):
            benchmark.pedantic(lambda: None, rounds=2)
    """)
    result = pytester.runpytest("-p", "no:cacheprovider", "--benchmark-disable-gc")
    result.assert_outcomes(passed=3)
    text = result.stdout.str()
    assert "per-call figures (extra_info)" in text
    table = [line for line in text[text.index("per-call figures (extra_info)"):].splitlines()[1:] if line.strip()][:3]
    lines = [line.split() for line in table]
    assert lines == [["benchmark", "us", "GB/s", "llama.cpp", "us"],
                     ["test_matvec[1]", "12.5", "3,270", "22.9"],
                     ["test_matvec[8]", "100.0", "408", "-"]]
