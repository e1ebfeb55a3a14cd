"""The checks made before start-up read a checkpoint's pickles without running code from them
(issue 57: a payload in an iteration's ``.metadata`` ran under ``--load`` and ``--print-plan``,
before any refusal). The tensor index is read by ``checkpoint.on_disk.IndexUnpickler`` (only the classes a
torch_dist index is made of), the common state by torch.load with weights_only given; a file
that needs anything else is refused unread, naming the file and the global, in both loops.
Real indexes, as torch and megatron-core write them, still read."""

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from megatron.moe_patches.checkpoint import on_disk
from megatron.moe_patches.driver.training import main

import checkpoint_files
from driver_model import REQUIRED
from fake_megatron_lm import fake_training, nothing_enabled  # noqa: F401  (autouse)
from test_megatron_lm_load_before_start import initialize  # noqa: F401  (the fixture: Megatron-LM's start-up)

pytestmark = pytest.mark.usefixtures("one_rank")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


class TouchMarker:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class ExecMarker(TouchMarker):
    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def system_global() -> str:
    return f"{os.system.__module__}.system"  # posix.system on Linux


# (payload class, the global the refusal names)
PAYLOADS = {"os.system": (TouchMarker, system_global), "builtins.exec": (ExecMarker, lambda: "builtins.exec")}


def hostile_checkpoint(tmp_path, payload, inside_a_real_index=False):
    """A --load directory whose iteration 4 has a ``.metadata`` carrying ``payload``: alone, or
    hidden in a real index (its storage_meta's modules). Returns (root, index file, marker)."""
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", iteration=4)
    index_file = root / "iter_0000004" / ".metadata"
    marker = tmp_path / "payload-ran"
    hostile = PAYLOADS[payload][0](marker)
    if inside_a_real_index:
        index = FileSystemReader(str(index_file.parent)).read_metadata()  # ours, written by torch: safe
        index.storage_meta = StorageMeta(modules=[hostile])
        hostile = index
    index_file.write_bytes(pickle.dumps(hostile))
    return root, index_file, marker


def refusal(index_file, payload) -> str:
    return (f"{index_file} is not safe to load: it needs {PAYLOADS[payload][1]()}, which no megatron-core checkpoint "
            "holds, so it was not read (reading it could run code); point --load at a checkpoint saved by megatron-core")


def test_the_payload_runs_under_a_plain_unpickle(tmp_path):
    """The payloads are live: torch's own reader runs them (what the checks must not do)."""
    for payload in PAYLOADS:
        _, index_file, marker = hostile_checkpoint(tmp_path / payload, payload)
        pickle.loads(index_file.read_bytes())
        assert marker.exists(), payload


# --- this package's driver: --load, and --load with --print-plan --------------------------


@pytest.mark.parametrize("inside", [False, True], ids=["alone", "inside a real index"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_the_driver_refuses_a_hostile_index_unread(tmp_path, refused, payload, inside):
    root, index_file, marker = hostile_checkpoint(tmp_path, payload, inside)
    assert refused([*REQUIRED, "--load", str(root)]) == refusal(index_file, payload)
    assert not marker.exists()


@pytest.mark.parametrize("payload", PAYLOADS)
def test_print_plan_refuses_a_hostile_index_unread(tmp_path, capsys, reverted, payload):
    root, index_file, marker = hostile_checkpoint(tmp_path, payload)
    with pytest.raises(SystemExit) as exited:
        main(["--yaml-cfg", "tiny-moe", "--train-iters", "20", "--load", str(root), "--print-plan"],
             prog="pretrain_gpt.py")
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert f"pretrain_gpt.py: error: {refusal(index_file, payload)}" in captured.err.splitlines()
    assert captured.out == "" and not marker.exists()


def test_a_hostile_index_in_an_older_iteration_is_refused_too(tmp_path, refused):
    """The resume advice reads the older iterations: their indexes are read the same way."""
    root, index_file, marker = hostile_checkpoint(tmp_path, "os.system")
    (root / checkpoint_files.checkpointing.TRACKER).write_text("8")  # a missing iteration: older ones are read
    assert refused([*REQUIRED, "--load", str(root)]) == refusal(index_file, "os.system")
    assert not marker.exists()


# --- Megatron-LM's loop (megatron_lm.enable()) ---------------------------------------------


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("step", [None, 4], ids=["tracker", "ckpt-step"])
def test_megatron_lm_refuses_a_hostile_index_unread(tmp_path, initialize, capsys, payload, step):
    root, index_file, marker = hostile_checkpoint(tmp_path, payload, inside_a_real_index=True)
    assert initialize(capsys, load=str(root), ckpt_step=step) == refusal(index_file, payload)
    assert not marker.exists()


def test_megatron_lm_refuses_a_hostile_common_state_unread(tmp_path, initialize, capsys, monkeypatch):
    root = checkpoint_files.checkpoint_root(tmp_path / "ckpt", iteration=4)
    common, marker = root / "iter_0000004" / "common.pt", tmp_path / "payload-ran"
    torch.save({"iteration": 4, "args": TouchMarker(marker)}, common)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # cannot turn the check's weights_only off
    line = initialize(capsys, load=str(root))
    assert line.startswith(f"{common} is not safe to load: it needs {system_global()}, ")
    assert not marker.exists()


# --- real indexes still read ---------------------------------------------------------------


def test_an_index_torch_writes_reads_as_torch_reads_it(tmp_path):
    """Every dtype, a bytes item, nested keys: the index of a real torch.distributed.checkpoint
    save (CPU, one process) reads back equal to what torch's own reader gives."""
    dtypes = [value for value in vars(torch).values() if isinstance(value, torch.dtype)]
    tensors = {f"t.{i}": torch.zeros(2, 3).to(dtype) for i, dtype in enumerate(dtypes) if _savable(dtype)}
    dcp.save({"model": tensors, "blob": b"bytes", "step": 3}, checkpoint_id=str(tmp_path), no_dist=True)
    ours = on_disk.read_index(str(tmp_path / ".metadata"))
    theirs = FileSystemReader(str(tmp_path)).read_metadata()
    assert isinstance(ours, Metadata) and len(ours.state_dict_metadata) > 10
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    assert on_disk.incomplete_reason(str(checkpoint_files.complete_iteration(tmp_path))) is None


def _savable(dtype) -> bool:
    try:
        torch.zeros(1).to(dtype)
        return True
    except (RuntimeError, TypeError):
        return False


def test_an_index_megatron_core_0192_writes_reads():
    """megatron-core 0.19.2's index also holds each rank's save plan (``all_local_plans``)."""
    index = on_disk.read_index(os.path.join(FIXTURES, "upstream_0192_ckpt", ".metadata"))
    assert on_disk.UPSTREAM_COMMON_KEY in index.state_dict_metadata and index.all_local_plans


def test_an_index_that_is_no_metadata_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(pickle.UnpicklingError, match="it holds a dict, not a torch_dist index"):
        on_disk.read_index(str(tmp_path / ".metadata"))


@pytest.mark.parametrize("module, name", [("torch", "load"), ("torch.distributed.checkpoint.metadata", "os"),
                                          ("builtins", "getattr"), ("torch", "Size.__init__")])
def test_only_the_listed_globals_resolve(module, name):
    with pytest.raises(on_disk.ForbiddenGlobal) as refused:
        on_disk.IndexUnpickler(io.BytesIO(b"")).find_class(module, name)
    assert refused.value.name == f"{module}.{name}"
