"""The flags pretrain_gpt.py requires, as Megatron-LM does, for the driver's CPU tests.

Megatron-LM has no defaults for the model's size, the sequence length, the vocabulary, the
batch, the run's length or the learning rate. ``REQUIRED`` gives them the small dense GPT
that the driver defaulted to before it took Megatron-LM's defaults; a test's own flags
after it override them.
"""

MODEL = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8"]
RUN = ["--seq-length", "512", "--max-position-embeddings", "512", "--vocab-size", "32000",
       "--micro-batch-size", "1", "--train-iters", "100", "--lr", "1e-4"]
REQUIRED = MODEL + RUN


def indexed_dataset(folder, name="data"):
    """An (empty) Megatron indexed dataset's files, ``name``.bin and ``name``.idx in ``folder``:
    what --data-path checks before start-up (the index's header: magic, version 1, int32
    tokens, no sequences or documents). Returns the prefix."""
    prefix = folder / name
    prefix.with_name(name + ".bin").touch()
    header = b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([4]) + (0).to_bytes(8, "little") * 2
    prefix.with_name(name + ".idx").write_bytes(header)
    return str(prefix)
