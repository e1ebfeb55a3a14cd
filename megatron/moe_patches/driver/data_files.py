"""The training data as given: --data-path's prefixes and weights (each prefix an indexed
dataset whose index megatron-core reads) and --split's weights, as megatron-core reads them."""

import argparse
import math
import os
import re
from typing import List, Optional, Tuple

from megatron.moe_patches.fields import shown

# One weight of --split as megatron-core reads it: the digits and dots of the text
# (re.findall("[.0-9]+")); a weight spelled otherwise ("-1", "1e3", "nan") would be read as other weights.
SPLIT_WEIGHT = re.compile(r"[0-9]*\.?[0-9]+|[0-9]+\.")
SPLIT_SEPARATOR = re.compile(r"\s*[,/]\s*")


def check_split(args: argparse.Namespace) -> None:
    """--split: up to three weights (train, validation, test) separated by commas or slashes, as
    megatron-core reads them (missing ones are 0, as there), not all 0. Any other text megatron-core
    would read as other weights (it skips all but digits and dots), as NaN shares, or stop on."""
    if args.split is None:
        return
    weights = SPLIT_SEPARATOR.split(args.split.strip())
    fix = "give up to three weights (train, validation, test) separated by commas, e.g. 969,30,1"
    if len(weights) > 3 or not all(SPLIT_WEIGHT.fullmatch(weight) for weight in weights):
        raise ValueError(f"--split {shown(args.split)!r}: not weights megatron-core reads as written: {fix}")
    if not sum(float(weight) for weight in weights) > 0:
        raise ValueError(f"--split {shown(args.split)!r}: the weights add up to 0, so no split gets a share: {fix}")
    if float(weights[0]) == 0 and getattr(args, "data_path", None):  # mock data: megatron-core splits it 1,1,1
        raise ValueError(f"--split {shown(args.split)!r} with --data-path: the training split (the first weight) is "
                         "empty, so there is nothing to train on: give it a share, e.g. 969,30,1")


def check_validation_split(args: argparse.Namespace) -> None:
    """Evaluation reads the validation split: one that --split leaves empty would make
    --eval-interval change nothing (Megatron-LM then skips evaluation without a word)."""
    if not (args.eval_interval and args.eval_iters) or args.split is None:
        return  # no --split: megatron-core splits mock data 1,1,1; --data-path has the legacy split by now
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    try:
        weights = parse_and_normalize_split(args.split)
    except (AssertionError, ValueError, ZeroDivisionError):
        return  # not a split megatron-core reads: left to its own refusal at start-up
    if len(weights) < 2 or weights[1] == 0:
        raise ValueError(f"--eval-interval {args.eval_interval} with --split {shown(args.split)}: the validation split "
                         "(the second weight) is empty, so there is nothing to evaluate on: give it a share, "
                         "or drop --eval-interval")


def data_blend(data_path: List[str]) -> Tuple[List[str], Optional[List[float]]]:
    """--data-path as Megatron-LM reads it: (prefixes, weights). Weight-prefix pairs where
    the list has an even length and every entry in a weight's place is a number; otherwise
    every entry is a prefix (weights None)."""
    weights = data_path[0::2]
    if len(data_path) % 2 == 0 and all(_is_number(weight) for weight in weights):
        return list(data_path[1::2]), [float(weight) for weight in weights]
    return list(data_path), None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# Megatron's indexed dataset: the tokens in PREFIX.bin, their index in PREFIX.idx.
DATASET_FILES = (".bin", ".idx")


def check_data_path(args: argparse.Namespace) -> None:
    """Every --data-path prefix names an indexed dataset, and the weights can blend them."""
    if not args.data_path:
        return
    prefixes, weights = data_blend(args.data_path)
    for weight in weights or []:
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"--data-path weight {weight}: must be a finite number, at least 0")
    if weights and not sum(weights) > 0:
        raise ValueError("--data-path: every weight is 0; give at least one dataset a positive weight")
    for prefix in prefixes:
        missing = [prefix + ending for ending in DATASET_FILES if not os.path.isfile(prefix + ending)]
        if missing:
            raise ValueError(
                f"--data-path {shown(prefix)}: no indexed dataset there ({', '.join(map(shown, missing))} not "
                "found); give each dataset's path without .bin/.idx, or leave --data-path out for mock data"
            )
        problem = _index_header_problem(prefix + ".idx")
        if problem:
            raise ValueError(f"--data-path {shown(prefix)}: {shown(prefix + '.idx')} {problem}; rebuild the dataset "
                             "with Megatron-LM's tools/preprocess_data.py, or point --data-path at another one")


# megatron-core's indexed-dataset index opens with this magic, then format version 1 (uint64,
# little-endian) and the tokens' dtype code (one byte, 1-8).
INDEX_MAGIC = b"MMIDIDX\x00\x00"


def _index_header_problem(path: str) -> Optional[str]:
    """Why ``path`` is no megatron-core dataset index (its first 18 bytes read), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(INDEX_MAGIC) + 9)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if not head.startswith(INDEX_MAGIC):
        return "is not a megatron-core dataset index (its first bytes are not the index header)"
    if len(head) < len(INDEX_MAGIC) + 9:
        return "ends inside its header"
    version = int.from_bytes(head[len(INDEX_MAGIC):len(INDEX_MAGIC) + 8], "little")
    dtype_code = head[-1]
    if version != 1 or not 1 <= dtype_code <= 8:
        return f"has index format version {version} and dtype code {dtype_code} (megatron-core reads version 1, codes 1-8)"
    return None
