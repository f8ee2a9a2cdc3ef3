"""Shared test fixtures (helpers live in the ``support`` package). GPU tests are marked ``gpu`` and skip cleanly
when CUDA is absent; ``one_thread`` runs a test on one intra-op thread.

A GPU test still running after ``DSV4_GPU_TEST_TIMEOUT`` seconds (default 600; 0 disables) ends the pytest
process with exit status 70 and every thread's traceback: a hung kernel blocks the test inside a CUDA call, where
nothing in Python can interrupt it, and must read as a hang rather than as a run that did not finish."""

import faulthandler
import os
import sys
import threading

import pytest
import torch

GPU_TEST_TIMEOUT = float(os.environ.get("DSV4_GPU_TEST_TIMEOUT", "600"))
HANG_EXIT_STATUS = 70


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _report_hang(config, nodeid: str, seconds: float) -> None:
    """The watchdog's end: the tracebacks past pytest's output capture, then the process exits."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    sys.stderr.write(f"\n{nodeid}: still running after {seconds:.0f} s (DSV4_GPU_TEST_TIMEOUT) — a hung kernel? "
                     "Every thread's traceback:\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(HANG_EXIT_STATUS)


@pytest.fixture(autouse=True)
def _gpu_hang_watchdog(request):
    """Arms the hang watchdog around each ``gpu`` test (see the module docstring)."""
    if GPU_TEST_TIMEOUT <= 0 or "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    timer = threading.Timer(GPU_TEST_TIMEOUT, _report_hang, (request.config, request.node.nodeid, GPU_TEST_TIMEOUT))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture
def one_thread():
    """One intra-op thread for the duration of a test: these tests run many small tensor ops, which are faster on
    one thread, and much faster on a shared, busy machine (no oversubscription)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
