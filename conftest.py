"""The suite's accounting, for every test of `make test` (tests/ and fxtrain's doctests): where the CPU goes.

tests/conftest.py holds the test settings; this file sits at the root so that the doctests of ``fxtrain`` are
counted too.
"""

import json
import os

import pytest

# --- where the suite's CPU goes (issue 36: the 10-minute budget on 2 cores) ---------------------------------
# Wall-clock durations (--durations) stretch with the machine's load and another worker's world; CPU seconds
# do not. Each test's CPU (this process's and its finished children's: subprocesses, torchrun, a gloo world's
# ranks) rides on its report to the controller, which prints the 15 costliest files at the end.

_CPU_START = pytest.StashKey[float]()


def _cpu() -> float:
    t = os.times()  # user, system, children's user, children's system
    return t[0] + t[1] + t[2] + t[3]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_START] = _cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "call" and _CPU_START in item.stash:  # setup (module fixtures) and call
        item.user_properties.append(("cpu_s", round(_cpu() - item.stash[_CPU_START], 2)))
    yield


_CPU: dict = {}


_TESTS: dict = {}


def pytest_runtest_logreport(report):
    if report.when == "call":
        cpu = dict(report.user_properties).get("cpu_s")
        if cpu is not None:
            path = report.nodeid.split("::")[0]
            _CPU[path] = _CPU.get(path, 0.0) + cpu
            _TESTS[report.nodeid] = cpu


def pytest_terminal_summary(terminalreporter):
    if not _CPU or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    total = sum(_CPU.values())
    terminalreporter.section(f"CPU seconds by file (15 of {len(_CPU)}; all: {total:.0f} s)")
    for path, cpu in sorted(_CPU.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{cpu:8.1f} s  {100 * cpu / max(total, 1e-9):4.1f}%  {path}")
    if os.environ.get("FXTRAIN_CPU_JSON"):  # every test's CPU seconds, for a closer look
        with open(os.environ["FXTRAIN_CPU_JSON"], "w") as f:
            json.dump(_TESTS, f, indent=0)
