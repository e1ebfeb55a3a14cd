"""What a torch_dist checkpoint directory holds, read from its files alone (CPU, no process
group): usable before start-up, by this package's driver and by Megatron-LM's loop
(``megatron_lm.enable()``), which both save Megatron-LM's directory layout.

``find_checkpoint`` says what ``--load`` holds: a checkpoint, none (a reason: training starts
from scratch), or an error naming the file and the fix (``--load`` is a file, the tracker
names no saved iteration, or one that is not a complete checkpoint: ``incomplete_reason``
reads megatron-core's config, the tensor index, the tensor files' lengths and the common
state). ``read_common_state`` reads the common state in either form megatron-core writes it:
a ``common.pt`` beside the torch_dist files (0.16.1) or, as megatron-core 0.19.2 saves it,
one pickled object inside the torch_dist files. ``optimizer_layouts_saved_at`` reads the
expert parameter layout the patched distributed optimizer recorded (F7), and
``optimizer_layout_refusal`` applies that optimizer's rule to it.

None of it runs code from the files: the tensor index is unpickled by ``IndexUnpickler`` (the
classes a torch_dist index is made of, nothing else) and the common state by torch.load with
weights_only; a file needing any other global is refused unread, by name (``UnsafeCheckpointFile``).
"""

import importlib
import io
import json
import os
import pickle
import re
import stat
from typing import FrozenSet, List, Optional, Tuple

# The args that fix the shapes of the model's tensors, in the order messages name them: a
# checkpoint saved with other values holds another model, whose tensors megatron-core refuses
# only after start-up. Both loops compare them before start-up, each reading its own args.
# (swiglu: FC1 holds two projections with it.)
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "swiglu", "num_attention_heads",
                    "num_query_groups", "kv_channels", "num_experts", "moe_ffn_hidden_size",
                    "moe_shared_expert_intermediate_size")


def ffn_hidden_size_default(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's --ffn-hidden-size default: 4 x hidden, or with SwiGLU 2/3 of that (its two
    input projections keep the parameter count), rounded down to a multiple of 64."""
    if swiglu:
        return int(4 * hidden_size * 2 / 3 / 64) * 64
    return 4 * hidden_size


def _ffn_default(values: dict) -> Optional[int]:
    hidden = values.get("hidden_size")
    return None if hidden is None else ffn_hidden_size_default(hidden, bool(values.get("swiglu")))


def _kv_channels_default(values: dict) -> Optional[int]:
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    return hidden // heads if hidden and heads and hidden % heads == 0 else None


def _given(values: dict, name: str):
    """The value of ``name`` as given; query groups without --group-query-attention are unset
    (Megatron-LM's saved args keep a value there that no layer reads)."""
    if name == "num_query_groups" and values.get("group_query_attention") is False:
        return None
    return values.get(name)


def shape_value(values: dict, name: str):
    """The value of the shape arg ``name`` the model is built with, from a run's or a checkpoint's args."""
    value = _given(values, name)
    return MODEL_SHAPE[name](values) if value is None and MODEL_SHAPE[name] is not None else value


# The args that fix the shapes of the model's tensors and the vocabulary, each with the value
# the model is built with where it is unset (a function of the other args), or None: unset is
# no such size (no experts, no shared expert), or, for ``REQUIRED_SHAPE_ARGS``, not given yet
# (the loop says so) or a tokenizer's own vocabulary. A checkpoint of other shapes is another
# model: megatron-core also loads an embedding table of another vocabulary without a word (the
# rows both have, the rest zeros).
_BUILT_WITH_WHEN_UNSET = {
    "ffn_hidden_size": _ffn_default,
    "num_query_groups": lambda values: values.get("num_attention_heads"),  # unset: one per head
    "kv_channels": _kv_channels_default,
    "moe_ffn_hidden_size": lambda values: shape_value(values, "ffn_hidden_size") if values.get("num_experts") else None,
}
# vocab_size: the token ids, end of document included (the embedding table's rows, unpadded)
MODEL_SHAPE = {name: _BUILT_WITH_WHEN_UNSET.get(name) for name in (*MODEL_SHAPE_ARGS, "vocab_size")}
REQUIRED_SHAPE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def model_shape_differences(saved: dict, run: dict) -> List[Tuple[str, object, object]]:
    """(arg, checkpoint's value, run's value) for each ``MODEL_SHAPE`` arg the checkpoint saved
    that builds another shape than the run's args: both loops' one rule before --load. A value
    the run derives (it did not give the flag) is not reported where the checkpoint's own args
    derive the saved one, or where the run has no such size: the args it derives from differ,
    and are reported."""
    differences = []
    for name, default in MODEL_SHAPE.items():
        if name not in saved:
            continue  # saved before the arg existed
        saved_value, run_value = shape_value(saved, name), shape_value(run, name)
        if name in REQUIRED_SHAPE_ARGS and (saved_value is None or run_value is None):
            continue
        derived = _given(run, name) is None and default is not None
        if saved_value == run_value or (derived and (run_value is None or default(saved) == saved_value)):
            continue
        differences.append((name, saved_value, run_value))
    return differences

TRACKER = "latest_checkpointed_iteration.txt"
# The torch_dist item megatron-core 0.19.2 saves the common state as (a ShardedObject named
# "common_state", of global shape (1,) at offset (0,), under its unique key); its bytes are
# torch.save of a one-element list holding the common state dict.
UPSTREAM_COMMON_KEY = "common_state/shard_0_1"

# --- the tensor index (``.metadata``, a pickle), read without running code from it ----------
# torch's ``FileSystemReader.read_metadata`` unpickles the index with ``pickle.load``, which calls
# whatever the file names. The checks made before start-up (``--load``, ``--print-plan``) read
# checkpoints a user may have downloaded, so they read the index with an unpickler that resolves
# only the classes a torch_dist index is made of and refuses any other global by name, before
# anything is called.

# The globals a torch_dist index pickle names (torch 2.6 to 2.13, megatron-core's writers
# too), by module. Resolving each only constructs data: dataclasses, a Size from a tuple, an
# enum or a layout from its name, a path from strings.
INDEX_GLOBALS = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    # megatron-core 0.19 keeps each rank's save plan in the index too (``all_local_plans``)
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "bytearray"}),
}

_DTYPE_NAMES: Optional[FrozenSet[str]] = None


def _dtype_names() -> FrozenSet[str]:
    """The names under which torch's dtypes pickle (``torch.bfloat16``, ...)."""
    global _DTYPE_NAMES
    if _DTYPE_NAMES is None:
        import torch

        _DTYPE_NAMES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))
    return _DTYPE_NAMES


class ForbiddenGlobal(pickle.UnpicklingError):
    """A pickle names a global outside ``INDEX_GLOBALS``; ``name`` is it, as module.name."""

    def __init__(self, module: str, name: str):
        self.name = f"{module}.{name}"
        super().__init__(f"it needs {self.name}, which no torch_dist index holds")


class IndexUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``INDEX_GLOBALS`` and torch's dtypes."""

    def find_class(self, module, name):
        allowed = name in INDEX_GLOBALS.get(module, ()) or (module == "torch" and name in _dtype_names())
        if not allowed:
            raise ForbiddenGlobal(module, name)
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid):  # an index holds no out-of-band objects
        raise pickle.UnpicklingError("it holds a persistent id, which no torch_dist index holds")


def read_index(path: str):
    """The torch DCP ``Metadata`` in the file ``path``, read with ``IndexUnpickler``. Raises
    ForbiddenGlobal for a file naming any other global, and pickle.UnpicklingError for one
    holding anything but a Metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(path, "rb") as handle:
        index = IndexUnpickler(handle).load()
    if not isinstance(index, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(index).__name__}, not a torch_dist index")
    return index


def safe_reader(checkpoint_dir: str):
    """A torch ``FileSystemReader`` of ``checkpoint_dir`` whose index is read by ``read_index``
    (for ``torch.distributed.checkpoint.load``, which reads the index through its reader)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeIndexReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            index = read_index(os.path.join(checkpoint_dir, ".metadata"))
            if getattr(index, "storage_meta", None) is None:
                index.storage_meta = StorageMeta()
            index.storage_meta.load_id = self.load_id  # as torch's reader leaves it
            return index

    return SafeIndexReader(checkpoint_dir)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


class CheckpointError(ValueError):
    """A ``--load`` that cannot be used; the message names the file and the fix."""


# The most of a tracker file that is read: an iteration number is a few digits, so a longer
# file (it may be anything, gigabytes of it) is refused from its first bytes, never read whole.
TRACKER_READ_LIMIT = 64


def _os_error(err: OSError) -> str:
    """What an OS error says went wrong, without the path it names (the message names it)."""
    return err.strerror or type(err).__name__


def tracker_text(root: str) -> Optional[str]:
    """What the tracker file under ``root`` holds, stripped; None without a tracker. At most
    ``TRACKER_READ_LIMIT`` bytes of it are read: a longer one is refused. A tracker of that
    name that is no regular file (a directory, a pipe, a device) is never read and is refused:
    a checkpoint was plainly meant, and training from scratch would hide it."""
    tracker = os.path.join(root, TRACKER)
    cannot_read = f"cannot read the checkpoint tracker {tracker}"
    fix = "give this user read access to it, or point --load elsewhere"
    try:
        mode = os.stat(tracker).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise CheckpointError(f"--load {root}: the checkpoint tracker {tracker} is {kind}: make it a file "
                                  "holding the iteration to resume from (e.g. 100 for iter_0000100), or point "
                                  "--load elsewhere")
        with open(tracker, "rb") as handle:
            head = handle.read(TRACKER_READ_LIMIT + 1)
            size = os.fstat(handle.fileno()).st_size
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CheckpointError(f"{cannot_read}: {_os_error(err)}; {fix}") from None
    if len(head) > TRACKER_READ_LIMIT:
        start = head[:40].decode("utf-8", errors="replace")
        raise CheckpointError(f"the checkpoint tracker {tracker} holds {max(size, len(head))} bytes, starting "
                              f"{start!r}, {NOT_AN_ITERATION}")
    try:
        return head.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{cannot_read}: {err}") from None


NOT_AN_ITERATION = ("not an iteration number: write the iteration of a saved checkpoint into it (e.g. 100 for "
                    "iter_0000100) or point --load elsewhere")


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the tracker file under ``root`` names (``tracker_text``); None without a
    tracker."""
    text = tracker_text(root)
    if text is None:
        return None
    if not re.fullmatch(r"[0-9]+", text):
        raise CheckpointError(f"the checkpoint tracker {os.path.join(root, TRACKER)} holds {text[:40]!r}, "
                              f"{NOT_AN_ITERATION}")
    return int(text)


# megatron-core's torch_dist files besides the tensor files: its checkpoint config (the last
# file its save writes), the torch DCP index of the tensor files, and the common state
# (iteration, scheduler, args; the first file written, by rank 0).
CONFIG_FILE = "metadata.json"
TENSOR_INDEX = ".metadata"
COMMON_FILE = "common.pt"
# Where save() writes an iteration before it has all of it (never loaded; the next save
# removes it), and where it moves a complete iteration of that number aside while the new
# one takes its name.
INCOMPLETE = ".incomplete"
REPLACED = ".replaced"
SAVED_ITERATION = re.compile(r"iter_([0-9]{7,})")
KILLED_SAVE = re.compile(r"iter_[0-9]{7,}" + re.escape(INCOMPLETE))
REPLACED_COPY = re.compile(r"iter_[0-9]{7,}" + re.escape(REPLACED))


def _read_error(err: BaseException) -> str:
    """A read error on one short line: its type, and what it says went wrong."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", " ".join(str(err).split()))  # torch's message has terminal bold
    if "WeightsUnpickler error:" in text:  # torch.load(weights_only=True): keep what it refused
        text = text.split("WeightsUnpickler error:", 1)[1].split(" Please ")[0].split(" Check the documentation")[0]
    text = text.strip().split(". ")[0][:200]  # the first sentence says what; the rest, what torch advises
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _config_problem(path: str) -> Optional[str]:
    config = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config):
        return f"no {CONFIG_FILE}, which megatron-core writes last: the save did not finish"
    try:
        with open(config, encoding="utf-8") as handle:
            values = json.load(handle)
    except (OSError, ValueError) as err:
        return f"its {CONFIG_FILE} cannot be read ({_read_error(err)})"
    backend = values.get("sharded_backend") if isinstance(values, dict) else None
    if backend != "torch_dist":
        return f"its {CONFIG_FILE} names the sharded backend {backend!r}; pretrain_gpt.py reads torch_dist"
    return None


class UnsafeCheckpointFile(CheckpointError):
    """A pickled checkpoint file naming a global its kind never holds: refused unread, whatever
    else is asked of the checkpoint (never taken for an incomplete save)."""


def unsafe_file_refusal(what: str, name: str, fix: str) -> UnsafeCheckpointFile:
    """The refusal of ``what`` (a file, or an item of one) whose pickle needs the global ``name``."""
    return UnsafeCheckpointFile(f"{what} is not safe to load: it needs {name}, which no megatron-core checkpoint "
                                f"holds, so it was not read (reading it could run code); {fix}")


SAVED_BY_MEGATRON_CORE = "point --load at a checkpoint saved by megatron-core"


def read_tensor_index(path: str):
    """The torch DCP index (``.metadata``) of the iteration directory ``path``, read without
    running code from it (``IndexUnpickler``). A file naming any global its kind never holds raises
    CheckpointError naming the file and the global; other read errors are raised as they come."""
    file = os.path.join(path, TENSOR_INDEX)
    try:
        return read_index(file)
    except ForbiddenGlobal as err:
        raise unsafe_file_refusal(file, err.name, SAVED_BY_MEGATRON_CORE) from None


def _tensor_index(path: str):
    """(the torch DCP index of the tensor files, None) or (None, why it cannot be had)."""
    if not os.path.isfile(os.path.join(path, TENSOR_INDEX)):
        return None, f"no {TENSOR_INDEX} (the index of its tensor files)"
    try:
        return read_tensor_index(path), None
    except UnsafeCheckpointFile:
        raise
    except Exception as err:  # a cut-short or foreign pickle raises any unpickling error
        return None, f"its {TENSOR_INDEX} cannot be read ({_read_error(err)})"


def _tensor_files_problem(path: str, index) -> Optional[str]:
    """A tensor file the index names that is missing or shorter than the bytes it indexes there."""
    needed = {}
    for where in (getattr(index, "storage_data", None) or {}).values():
        name = getattr(where, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), where.offset + where.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name}, a tensor file its {TENSOR_INDEX} names, is missing"
        if os.path.getsize(file) < size:
            return f"{name} is cut short ({os.path.getsize(file)} bytes, its {TENSOR_INDEX} indexes {size})"
    return None


def _common_state_problem(path: str, index) -> Optional[str]:
    """The common state, read as ``load`` reads it (``read_common_state``), and whether it is a dict."""
    if not os.path.isfile(os.path.join(path, COMMON_FILE)) and UPSTREAM_COMMON_KEY not in index.state_dict_metadata:
        return f"no {COMMON_FILE} (its common state: iteration, scheduler, args)"
    try:
        common = read_common_state(path)
    except UnsafeCheckpointFile:
        raise
    except Exception as err:  # torch.load's errors on cut-short or foreign bytes, CheckpointError
        return f"its common state cannot be read ({_read_error(err)})"
    if not isinstance(common, dict):
        return f"its common state is a {type(common).__name__}, not a dict"
    return None


def incomplete_reason(path: str) -> Optional[str]:
    """Why the iteration directory ``path`` is not a complete torch_dist checkpoint, or None.

    Complete: megatron-core's config, the index of the tensor files, every tensor file it names
    at the length it indexes, and a common state that reads back as ``load`` reads it. Reads
    files only (CPU, no process group): usable before start-up.
    """
    if not os.path.isdir(path):
        return "it is not a directory"
    error = _unreadable(path)
    if error is not None:
        return f"it cannot be read: {_os_error(error)}"
    if not os.listdir(path):
        return "it is empty"
    problem = _config_problem(path)
    if problem is not None:
        return problem
    index, problem = _tensor_index(path)
    if problem is not None:
        return problem
    return _tensor_files_problem(path, index) or _common_state_problem(path, index)


def saved_iterations(root: str) -> List[int]:
    """The iterations with an ``iter_NNNNNNN`` directory under ``root``, newest first."""
    found = []
    for name in os.listdir(root):
        match = SAVED_ITERATION.fullmatch(name)
        if match and os.path.basename(iteration_dir(root, int(match.group(1)))) == name:
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def newest_complete_iteration(root: str) -> Optional[int]:
    """The newest iteration under ``root`` saved completely; None without one."""
    for iteration in saved_iterations(root):
        if incomplete_reason(iteration_dir(root, iteration)) is None:
            return iteration
    return None


def _unusable_iteration(root: str, iteration: int, path: str) -> CheckpointError:
    """The refusal of a tracker naming an iteration ``path`` cannot resume from, with the fix."""
    tracker = os.path.join(root, TRACKER)
    if os.path.lexists(path):
        what = f"{path} is not a complete checkpoint ({incomplete_reason(path)})"
    else:
        what = f"{path} does not exist"
    newest = newest_complete_iteration(root)
    if newest is not None:
        fix = (f"write {newest} into {TRACKER} to resume from {iteration_dir(root, newest)}, the newest "
               "complete checkpoint there, or point --load at another checkpoint")
    else:
        fix = ("no complete checkpoint is there: point --load at another checkpoint, or at an empty "
               "directory to train from scratch")
    return CheckpointError(f"--load {root}: the checkpoint tracker {tracker} names iteration {iteration}, "
                           f"but {what}; {fix}")


def _unreadable(folder: str) -> Optional[OSError]:
    """The OS error that listing the directory ``folder`` or looking up an entry in it raises
    (no read or no execute permission); None where both work."""
    try:
        for name in os.listdir(folder)[:1]:
            os.lstat(os.path.join(folder, name))
    except OSError as err:
        return err
    return None


def _check_readable(root: str, folder: str) -> None:
    error = _unreadable(folder)
    if error is not None:
        raise CheckpointError(f"--load {root}: cannot read {folder}: {_os_error(error)}; give this user read and "
                              "execute permission on it (chmod u+rx), or point --load elsewhere")


def missing_checkpoint_refusal(root: str, missing: str) -> CheckpointError:
    """--exit-on-missing-checkpoint's refusal of a ``--load`` without a checkpoint (``missing``:
    ``find_checkpoint``'s reason)."""
    return CheckpointError(f"--load {root}: {missing}, and --exit-on-missing-checkpoint is set: point --load at a "
                           "checkpoint directory, or drop --exit-on-missing-checkpoint to train from scratch")


def _refuse_an_iteration_given(root: str) -> None:
    """``--load`` given one iteration's directory (``iter_*``, holding its files) instead of the
    checkpoint directory above it: no tracker there, so it would train from scratch."""
    held = [name for name in (COMMON_FILE, CONFIG_FILE, TENSOR_INDEX) if os.path.isfile(os.path.join(root, name))]
    if held:
        parent = os.path.dirname(os.path.normpath(root)) or "."
        raise CheckpointError(f"--load {root} is one iteration of a checkpoint (it holds {', '.join(held)}), not "
                              f"the checkpoint directory: point --load at the directory above it ({parent}), which "
                              f"holds {TRACKER}")


def find_checkpoint(root: str) -> Tuple[Optional[str], Optional[str]]:
    """(the checkpoint directory ``--load root`` resumes from, None) or (None, why there is none).

    No directory, an empty one or one without a tracker file is "no checkpoint" (Megatron-LM
    trains from scratch then). A ``root`` that is a file, a tracker that is not an iteration
    number or no regular file, or one naming an iteration whose directory is missing or not a
    complete checkpoint (``incomplete_reason``) raises CheckpointError naming the file and the
    fix, and so do a ``root`` that is one iteration's directory and a ``root``, tracker or
    named iteration this user cannot read (the OS error named). A save
    killed between its two renames (``_publish``) left the named iteration under its
    ``.replaced`` name, complete: that is the checkpoint then.
    """
    try:
        os.stat(root)
    except (FileNotFoundError, NotADirectoryError):
        return None, "no such directory"
    except OSError as err:  # a parent this user may not enter, a symlink loop
        raise CheckpointError(f"--load {root}: cannot read it: {_os_error(err)}; give this user access to it and "
                              "its parent directories, or point --load elsewhere") from None
    if not os.path.isdir(root):
        raise CheckpointError(
            f"--load {root} is a file, not a checkpoint directory: point --load at the directory "
            f"that holds {TRACKER} and the iter_* directories"
        )
    _check_readable(root, root)
    iteration = latest_iteration(root)
    if iteration is None:
        _refuse_an_iteration_given(root)
        return None, "the directory is empty" if not os.listdir(root) else f"no checkpoint there (no {TRACKER})"
    path = iteration_dir(root, iteration)
    if os.path.isdir(path):
        _check_readable(root, path)
    if os.path.lexists(path):
        if incomplete_reason(path) is None:
            return path, None
    elif os.path.isdir(path + REPLACED) and incomplete_reason(path + REPLACED) is None:
        return path + REPLACED, None
    raise _unusable_iteration(root, iteration, path)



def _load_weights_only(source, what: str):
    """torch.load of ``source`` (``what``: the file or item, for messages) with weights_only
    given explicitly (no environment variable turns it off): only the types torch and
    megatron-core allow (megatron-core registers argparse.Namespace, numpy arrays and its own
    enums on import) come back. Any other global is refused by name, before it is called."""
    import torch

    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL ([\w.]*\w)", str(err))  # torch names the global it refused so
        if named is None:
            raise  # not a pickle torch can read (cut short, random bytes): the caller says so
        raise unsafe_file_refusal(what, named.group(1), f"{SAVED_BY_MEGATRON_CORE}, or load it with the version "
                                  "that saved it") from None


def _read_common_file(file: str):
    """The common state megatron-core 0.16.1 saves as ``common.pt``, read as its own load reads
    it (torch.load, weights only)."""
    return _load_weights_only(file, file)


def read_common_state(path: str) -> dict:
    """The common state (args, iteration, scheduler, ...) of the torch_dist checkpoint at
    ``path``, on CPU without a process group, whichever megatron-core saved it.

    A ``common.pt`` there is read as megatron-core's own ``load_common_state_dict`` reads
    it, with weights_only given explicitly. Without one, the state is the ``UPSTREAM_COMMON_KEY`` item of the torch_dist files
    (megatron-core 0.19.2 writes no common.pt, and 0.16.1's reader looks only for that
    file); it is read with torch.distributed.checkpoint (its index by ``IndexUnpickler``) and
    unpickled with ``weights_only=True``, so only the types torch and megatron-core allow (megatron-core
    registers argparse.Namespace and its own enums on import) come back. A directory
    holding neither raises CheckpointError.
    """
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    if os.path.isfile(os.path.join(path, COMMON_STATE_FNAME)):
        return _read_common_file(os.path.join(path, COMMON_STATE_FNAME))

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    neither = CheckpointError(
        f"{path} holds no common state: neither {COMMON_STATE_FNAME} nor a torch_dist "
        f"'{UPSTREAM_COMMON_KEY}' item (the save did not finish, or it is not a megatron-core "
        "torch_dist checkpoint); point --load at a complete one"
    )
    try:
        metadata = read_tensor_index(path)
    except FileNotFoundError:  # no .metadata: not torch_dist files at all
        raise neither from None
    if not isinstance(metadata.state_dict_metadata.get(UPSTREAM_COMMON_KEY), BytesStorageMetadata):
        raise neither

    class KeepBytes(DefaultLoadPlanner):
        # The default planner unpickles saved bytes with weights_only=False (any object);
        # keep them raw, to unpickle below with the allow-list.
        def load_bytes(self, read_item, value):
            self.saved = value.getvalue()

    planner = KeepBytes(flatten_state_dict=False)
    dcp_load({UPSTREAM_COMMON_KEY: io.BytesIO()}, storage_reader=safe_reader(path), planner=planner,
             no_dist=True)
    saved = _load_weights_only(io.BytesIO(planner.saved), f"the '{UPSTREAM_COMMON_KEY}' item of {path}")
    if not (isinstance(saved, list) and len(saved) == 1 and isinstance(saved[0], dict)):
        raise CheckpointError(
            f"the '{UPSTREAM_COMMON_KEY}' item of {path} is not a common state dict (a "
            f"{type(saved).__name__}); point --load at a checkpoint saved by megatron-core"
        )
    return saved[0]



def optimizer_layouts_saved_at(path: str) -> list:
    """(sharding type, recorded expert parameter layout or None) of each distributed optimizer
    whose states the checkpoint at ``path`` holds, from its common state (CPU, no process
    group: usable before start-up); a chained optimizer (EP > 1: dense and expert) gives one
    pair per optimizer."""
    from megatron.moe_patches.checkpoint.optimizer_state import LAYOUT_KEY

    found = []

    def visit(node, depth):
        if not isinstance(node, dict) or depth > 4:  # a chain nests optimizers by index, shallowly
            return
        if "param_state_sharding_type" in node:
            found.append((node["param_state_sharding_type"], node.get(LAYOUT_KEY)))
            return
        for value in node.values():
            visit(value, depth + 1)

    visit(read_common_state(path).get("optimizer"), 0)
    return found


def optimizer_layout_refusal(path: str, run) -> Optional[str]:
    """Why the distributed-optimizer states saved at ``path`` cannot load into ``run`` (its
    args or config: the expert parameter layout it sets), or None: the patched optimizer's own
    rule (F7), read from the files before start-up."""
    from megatron.moe_patches.checkpoint.optimizer_state import bucket_layout_refusal, param_layout

    current = param_layout(run)
    for sharding_type, saved in optimizer_layouts_saved_at(path):
        refusal = bucket_layout_refusal(sharding_type, saved, current)
        if refusal is not None:
            return f"--load {path}: {refusal}"
    return None
