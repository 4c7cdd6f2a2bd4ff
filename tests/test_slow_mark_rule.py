"""tests/conftest.py's rule: a test that starts a Python subprocess or a multiprocessing child must
carry the `slow` mark (checked on a throwaway suite run in-process by pytester)."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


def test_unmarked_tests_that_start_processes_fail_and_name_what_they_started(pytester):
    pytester.makeconftest(CONFTEST.read_text(encoding="utf-8"))
    pytester.makepyfile(test_spawns='''
        import multiprocessing, subprocess, sys

        def test_python_subprocess():
            subprocess.run([sys.executable, "-c", "pass"])

        def test_multiprocessing_child():
            multiprocessing.get_context("spawn").Process(target=print).start()

        def test_other_executables_are_allowed():
            subprocess.run(["true"])
    ''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*test_python_subprocess starts a Python subprocess (*-c pass) without the `slow` mark*",
        "*test_multiprocessing_child starts a child process (*Process) without the `slow` mark*",
    ])
