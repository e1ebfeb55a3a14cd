"""The test suite's background runs (tests/conftest.py, ``BACKGROUND``): a test's run starts when
collection ends and the test gets its result; a test skipped at collection, by a skip marker or a
skipif already true (a module's ``pytestmark`` without MEGATRON_LM_PATH), starts none."""

import importlib.util
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

MODULE = '''
import time

import pytest

STARTED = []


def job(n):
    STARTED.append(n)
    return n * 2


BACKGROUND = {"test_gets_its_result": ("n", job), "test_skipped_by_skipif": ("n", job),
              "test_skipped_by_skip": ("n", job)}


@pytest.mark.parametrize("n", [1, 2])
def test_gets_its_result(n, background):
    assert background == n * 2


@pytest.mark.skipif(True, reason="not on this machine")
@pytest.mark.parametrize("n", [10])
def test_skipped_by_skipif(n, background):
    pass


@pytest.mark.skip(reason="never")
@pytest.mark.parametrize("n", [20])
def test_skipped_by_skip(n, background):
    pass


@pytest.mark.skipif(False, reason="runs")
@pytest.mark.parametrize("n", [3])
def test_kept_by_a_false_skipif(n, background):
    assert background == 6


BACKGROUND["test_kept_by_a_false_skipif"] = ("n", job)


def test_only_the_tests_that_run_started_runs():
    time.sleep(0.5)  # a started job appends at once
    assert sorted(STARTED) == [1, 2, 3]
'''


def test_tests_skipped_at_collection_start_no_runs(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_jobs.py").write_text(textwrap.dedent(MODULE))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          "--rootdir", str(tmp_path), str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "4 passed, 2 skipped" in run.stdout, run.stdout[-2000:]


def _pretrain_runs():
    """A fresh copy of tests/gpu/pretrain_runs.py (its own slots, ranks and threads)."""
    spec = importlib.util.spec_from_file_location("pretrain_runs_copy", TESTS / "gpu" / "pretrain_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _until(condition):
    deadline = time.monotonic() + 30
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_chain_keeps_its_rank_and_goes_before_later_requests():
    """Requests A, B, C start in that order while the one slot is taken; A's next run, asked
    for after B and C queued, still goes first (first in, first out gives B, C, A: the first
    test waiting for every later test's runs before it can report)."""
    runs = _pretrain_runs()
    slot, order, a_ready = runs.OrderedSlots(1), [], threading.Event()

    def one(name):
        with slot:
            order.append(name)

    def chain():
        a_ready.wait(30)
        runs.later(one, "A").result()

    with slot:  # a test's own thread holds the slot while the requests queue
        futures = [runs.later(chain), runs.later(one, "B"), runs.later(one, "C")]
        _until(lambda: len(slot._waiting) == 2)
        a_ready.set()
        _until(lambda: len(slot._waiting) == 3)
    for future in futures:
        future.result(timeout=30)
    assert order == ["A", "B", "C"]


def test_a_tests_own_thread_goes_before_every_queued_run():
    runs = _pretrain_runs()
    slot, order = runs.OrderedSlots(1), []

    def one(name):
        with slot:
            order.append(name)

    with slot:
        futures = [runs.later(one, "B"), runs.later(one, "C")]
        _until(lambda: len(slot._waiting) == 2)
        own = threading.Thread(target=one, args=("own",))  # a fresh thread: no rank, like pytest's
        own.start()
        _until(lambda: len(slot._waiting) == 3)
    own.join(30)
    for future in futures:
        future.result(timeout=30)
    assert order == ["own", "B", "C"]


def test_later_once_starts_one_run_per_function_and_arguments():
    runs = _pretrain_runs()
    calls = []

    def run(name):
        calls.append(name)
        return name

    first, again, other = runs.later_once(run, "A"), runs.later_once(run, "A"), runs.later_once(run, "B")
    assert first is again and other is not first
    assert (first.result(timeout=30), other.result(timeout=30)) == ("A", "B")
    assert sorted(calls) == ["A", "B"]
