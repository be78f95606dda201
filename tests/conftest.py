"""Strict test settings: warnings are errors (pyproject), deterministic torch, small thread count, logging
restored after every test."""

import logging
import os
import sys

import pytest
import torch

# Two threads, fewer when pytest-xdist workers share the cores (`make test` runs one worker per core, up to 4).
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))))


class _CurrentStderr:
    """A stream that writes to whatever ``sys.stderr`` is at the time (pytest's capture of the running test)
    and that nothing can close."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _absl_logs_to_the_current_stderr() -> None:
    # absl (imported by optax/jax) makes its handler at import with the sys.stderr of that moment: under
    # pytest's capture, the capture's file. Hydra's logging.config.dictConfig (in-process app runs) closes
    # every handler, and absl's close() closes its stream unless it is sys.stderr *now*: inside a capsys test
    # it is not, so pytest's stderr capture got closed and every later test of that xdist worker failed
    # ("I/O operation on closed file"). Its stream is made to follow sys.stderr instead.
    try:
        from absl import logging as absl_logging
    except ImportError:
        return
    absl_logging.get_absl_handler().python_handler.stream = _CurrentStderr()


_absl_logs_to_the_current_stderr()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield



@pytest.fixture(scope="module")
def one_rank_mesh(tmp_path_factory):
    """A 1-rank gloo mesh in this process (FileStore: no ports, no subprocess), for DTensor leaves in
    single-process tests (test_step.py, test_composable_step.py); the process group is this module's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (dist.get_world_size(),))
    if owned:
        dist.destroy_process_group()


@pytest.fixture
def mse_steps():
    """``mse_steps(net, tx, params, state, n, (x, y))``: ``n`` pure fxtrain steps (``tx.update``, then
    ``fx.apply_updates``) on the mean squared error of ``net`` called with ``params``
    (``torch.func.functional_call``); returns ``(params, state)``. The torch side of the interop tests' runs
    that continue across a framework boundary (tests/test_interop_nnx.py, tests/test_interop_orbax.py)."""
    import fxtrain as fx

    def steps(net, tx, params, state, n, data):
        x, y = data

        def loss(p):
            return torch.mean((torch.func.functional_call(net, p, (x,)) - y) ** 2)

        for _ in range(n):
            updates, state = tx.update(torch.func.grad(loss)(params), state, params)
            params = fx.apply_updates(params, updates)
        return params, state

    return steps

@pytest.fixture(autouse=True)
def _logging_restored():
    """Each test leaves logging as it found it: handlers, levels, propagation and ``disable`` of every logger.

    Tests that run the Hydra app in process (``fxtrain.train.main``) make Hydra call
    ``logging.config.dictConfig``, which removes the root logger's handlers, adds its own (a console handler
    on the test's captured stdout, ``train.log``) and may disable loggers. Under pytest-xdist a worker runs
    many test files in one process, so what one test configures must not reach the next (a handler writing
    to a capture stream that pytest has closed fails every later test of that worker).
    """
    manager = logging.Logger.manager
    loggers = [logging.getLogger(), *(x for x in manager.loggerDict.values() if isinstance(x, logging.Logger))]
    saved = [(x, [h for h in x.handlers if not _pytests(h)], x.level, x.propagate, x.disabled) for x in loggers]
    disable = manager.disable
    yield
    for x, handlers, level, propagate, disabled in saved:
        for h in x.handlers:
            if not (_pytests(h) or h in handlers):  # added by the test (Hydra's console, train.log): release it
                h.close()
        # pytest's capture handlers of the current phase stay: pytest removes them when the phase ends
        x.handlers[:] = [*handlers, *(h for h in x.handlers if _pytests(h))]
        x.level, x.propagate, x.disabled = level, propagate, disabled
    logging.disable(disable)
    manager._clear_cache()


def _pytests(handler: logging.Handler) -> bool:
    """Whether ``handler`` is one of pytest's own (caplog, the report's captured log, log_file), which it
    adds and removes around every setup, call and teardown."""
    return type(handler).__module__.startswith("_pytest.")


def pytest_collection_modifyitems(config, items):
    # Tests that need the `jax` extra skip cleanly when it is absent (the core must work without it).
    try:
        import optax  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="needs the `jax` extra (pip install fxtrain[jax])")
        for item in items:
            if "optax" in item.keywords or "jax" in item.keywords:
                item.add_marker(skip)
