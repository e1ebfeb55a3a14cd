"""A stand-in for Megatron-LM's ``megatron.training`` package in CPU tests (Megatron-LM is not
installed there): modules made from source text, registered for the test's duration."""

import sys
import textwrap
import types

import megatron
import pytest

from megatron.moe_patches import megatron_lm, revert


def fake_training(monkeypatch, modules):
    """Install a ``megatron.training`` package holding ``modules`` (name: source); returns it."""
    package = types.ModuleType("megatron.training")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setattr(megatron, "training", package, raising=False)
    for name, source in modules.items():
        module = types.ModuleType(f"megatron.training.{name}")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(textwrap.dedent(source), module.__dict__)
        setattr(package, name, module)
    return package


@pytest.fixture(autouse=True)
def nothing_enabled():
    """Every test starts and ends with megatron-core unpatched and Megatron-LM unwrapped (a test
    module that imports this fixture gets it for each of its tests)."""
    megatron_lm.disable()
    revert()
    yield
    megatron_lm.disable()
    revert()


# The parts of megatron.training that enable() wraps, as Megatron-LM core_v0.16.1 lays them out
# (module -> source).
MEGATRON_LM_MODULES = {
    # Megatron-LM returns (args, checkpoint_args) when it read a checkpoint's args, args alone
    # otherwise; here a "checkpoint" is an entry of SAVED_ARGS keyed by the --load directory.
    "checkpointing": """
        SAVED_ARGS = {}

        def load_args_from_checkpoint(args, load_arg="load", checkpointing_context=None):
            saved = SAVED_ARGS.get(getattr(args, load_arg))
            return args if saved is None else (args, saved)
    """,
    # As Megatron-LM's: its checks of the args, and the config built from them as its model
    # builder does (every TransformerConfig field the args hold).
    "arguments": """
        import dataclasses
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

        VALIDATED = []

        def validate_args(args, defaults={}):
            VALIDATED.append(args)
            # Megatron-LM core_v0.16.1's rule, written for inference's routers
            if getattr(args, "cuda_graph_impl", "none") == "local" and getattr(args, "expert_model_parallel_size", 1) > 1:
                assert args.moe_pad_experts_for_cuda_graph_inference, "--moe-pad-experts-for-cuda-graph-inference must be set"
            return args

        def core_transformer_config_from_args(args, config_class=None):
            config_class = config_class or TransformerConfig
            names = {f.name for f in dataclasses.fields(config_class)}
            return config_class(**{k: v for k, v in vars(args).items() if k in names})
    """,
    "yaml_arguments": """
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

        def validate_yaml(args, defaults={}):
            return args
    """,
    # As Megatron-LM's initialize.py: the functions imported by name, called through those names.
    "initialize": """
        from megatron.training.checkpointing import load_args_from_checkpoint
        from megatron.training.arguments import validate_args
        from megatron.training.yaml_arguments import validate_yaml

        def initialize_megatron(args):
            if args.use_checkpoint_args:
                load_args_from_checkpoint(args)
            if getattr(args, "yaml_cfg", None) is not None:
                args = validate_yaml(args, {})
            else:
                validate_args(args, {})
            return args
    """,
    "utils": """
        PRINTED = []
        print_rank_0 = PRINTED.append
        STOCK_BATCHES = []

        def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=False):
            STOCK_BATCHES.append(mtp_on_this_rank)
            return {"stock": next(data_iterator)}
    """,
}
