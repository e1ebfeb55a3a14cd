"""--use-checkpoint-args reads a checkpoint saved by Megatron-LM 0.16.1 as well as this
driver's own.

Megatron-LM keeps its whole argparse Namespace under the common state's "args" (this
driver saves a dict), with its own spellings of some model args. The fixture below is
written the way Megatron-LM 0.16.1 writes a torch_dist checkpoint with megatron-core
0.16.1: ``<save>/latest_checkpointed_iteration.txt`` naming the iteration,
``<save>/iter_0000020/`` holding the torch_dist files, megatron-core's ``metadata.json``
and ``common.pt``, the torch.save of the common state (args, checkpoint_version 3.0,
iteration, scheduler, FLOPs so far, content metadata).
"""

import argparse
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.moe_patches.driver import checkpointing, training

pytestmark = pytest.mark.usefixtures("one_rank")

ITERATION = 20


def megatron_lm_args(**overrides) -> argparse.Namespace:
    """A tiny MoE GPT's args as Megatron-LM's pretrain_gpt.py holds them when it saves (after
    its validate_args and tokenizer): its own flag dests, run settings, and values of types
    megatron-core allows in a checkpoint (a dtype, an enum)."""
    from megatron.core.transformer.enums import AttnBackend

    values = dict(
        # the model
        num_layers=4, hidden_size=512, ffn_hidden_size=1344, num_attention_heads=8,
        group_query_attention=True, num_query_groups=2, kv_channels=64, seq_length=1024,
        max_position_embeddings=1024, tokenizer_type="NullTokenizer", vocab_size=4096,
        make_vocab_size_divisible_by=128, padded_vocab_size=4224,  # its null tokenizer adds an eod token
        normalization="RMSNorm", swiglu=True, quick_geglu=False, squared_relu=False, add_bias_linear=False,
        add_qkv_bias=False, position_embedding_type="rope", rotary_base=500000, rotary_percent=1.0,
        untie_embeddings_and_output_weights=True, qk_layernorm=True, multi_latent_attention=False,
        num_experts=8, moe_ffn_hidden_size=256, moe_router_topk=2, moe_layer_freq=1,
        moe_shared_expert_intermediate_size=None, mtp_num_layers=None,
        # how it ran (never imposed on a resumed run)
        moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall", moe_permute_fusion=True,
        moe_aux_loss_coeff=0.01, transformer_impl="transformer_engine", attention_backend=AttnBackend.auto,
        bf16=True, fp16=False, params_dtype=torch.bfloat16, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
        world_size=2, rank=0, micro_batch_size=4, global_batch_size=32, train_iters=500, lr=3e-4,
        seed=4321, save="/checkpoints/run", load=None, ckpt_format="torch_dist", use_dist_ckpt=True,
        use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=False,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def megatron_lm_checkpoint(root, args: argparse.Namespace):
    """``root`` holding one checkpoint laid out as Megatron-LM 0.16.1 saves it (torch_dist)."""
    path = root / f"iter_{ITERATION:07d}"
    dcp.save({"decoder.final_layernorm.weight": torch.ones(args.hidden_size)}, checkpoint_id=str(path),
             no_dist=True)
    torch.save({
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 0.0, "num_steps": ITERATION * 32,
                                "decay_style": "cosine"},
        "num_floating_point_operations_so_far": 1.5e15,
        "content_metadata": {"singleton_local_shards": False, "distrib_optim_sharding_type": "dp_reshardable"},
    }, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1,
    }))
    (root / checkpointing.TRACKER).write_text(str(ITERATION))
    return root


# This run's settings (a checkpoint never imposes them).
RUN = ["--bf16", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--micro-batch-size", "2",
       "--train-iters", "40", "--lr", "0.001"]
# The model args the driver takes from that checkpoint, in its own names.
TAKEN = dict(
    num_layers=4, hidden_size=512, ffn_hidden_size=1344, num_attention_heads=8, num_query_groups=2,
    kv_channels=64, seq_length=1024, max_position_embeddings=1024, vocab_size=4224, normalization="RMSNorm",
    swiglu=True, disable_bias_linear=True, position_embedding_type="rope", rotary_base=500000,
    untie_embeddings_and_output_weights=True, qk_layernorm=True, num_experts=8, moe_ffn_hidden_size=256,
    moe_router_topk=2, moe_shared_expert_intermediate_size=None,
)


def test_the_fixture_reads_as_megatron_lm_wrote_it(tmp_path):
    """The common state comes back with the Namespace itself (megatron-core allows it)."""
    root = megatron_lm_checkpoint(tmp_path / "ckpt", megatron_lm_args())
    common = checkpointing.read_common_state(str(root / f"iter_{ITERATION:07d}"))
    assert isinstance(common["args"], argparse.Namespace) and common["checkpoint_version"] == 3.0
    assert checkpointing.find_checkpoint(str(root)) == (str(root / f"iter_{ITERATION:07d}"), None)


def test_saved_args_of_a_megatron_lm_checkpoint_are_in_the_drivers_names(tmp_path):
    saved = checkpointing.saved_args(str(megatron_lm_checkpoint(tmp_path / "ckpt", megatron_lm_args())))
    assert {name: saved[name] for name in TAKEN} == TAKEN


def test_use_checkpoint_args_restores_a_megatron_lm_checkpoints_args(tmp_path, parsed, capsys):
    root = megatron_lm_checkpoint(tmp_path / "ckpt", megatron_lm_args())
    capsys.readouterr()
    args = parsed(["--load", str(root), "--use-checkpoint-args", *RUN, "--hidden-size", "64"])
    assert {name: getattr(args, name) for name in TAKEN} == TAKEN  # the checkpoint's model, not --hidden-size 64
    # Run settings stay this run's, not Megatron-LM's.
    assert (args.micro_batch_size, args.train_iters, args.lr, args.expert_model_parallel_size) == (2, 40, 0.001, 1)
    assert args.seed != 4321
    assert "--use-checkpoint-args: took " in capsys.readouterr().out


def test_the_restored_megatron_lm_model_stops_only_at_the_gpu_check(tmp_path, capsys, monkeypatch):
    """The whole command, as megatron-moe-pretrain runs it: args restored and validated."""
    from megatron.moe_patches.driver.training import main

    root = megatron_lm_checkpoint(tmp_path / "ckpt", megatron_lm_args())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        main(["--load", str(root), "--use-checkpoint-args", *RUN], prog="megatron-moe-pretrain")
    assert stopped.value.code == training.no_gpu_message("megatron-moe-pretrain")
    assert ": error: " not in capsys.readouterr().err


@pytest.mark.parametrize("group_query_attention, num_query_groups", [(False, 2), (False, None)])
def test_without_group_query_attention_each_head_is_its_own_group(tmp_path, group_query_attention,
                                                                   num_query_groups):
    """Megatron-LM reads --num-query-groups only with --group-query-attention."""
    args = megatron_lm_args(group_query_attention=group_query_attention, num_query_groups=num_query_groups)
    saved = checkpointing.saved_args(str(megatron_lm_checkpoint(tmp_path / "ckpt", args)))
    assert saved["num_query_groups"] == 8 == saved["num_attention_heads"]


def test_biases_and_vocabulary_follow_megatron_lm(tmp_path):
    args = megatron_lm_args(add_bias_linear=True, tokenizer_type="GPT2BPETokenizer", vocab_size=None,
                            padded_vocab_size=50304)
    saved = checkpointing.saved_args(str(megatron_lm_checkpoint(tmp_path / "ckpt", args)))
    assert (saved["disable_bias_linear"], saved["vocab_size"]) == (False, 50304)


@pytest.mark.parametrize("override, shown", [
    (dict(multi_latent_attention=True), "--multi-latent-attention"),
    (dict(squared_relu=True), "--squared-relu"),
    (dict(moe_layer_freq=[1, 0, 1, 0]), "--moe-layer-freq [1, 0, 1, 0]"),
    (dict(mtp_num_layers=1), "--mtp-num-layers 1"),
    (dict(position_embedding_type="mrope"), "--position-embedding-type mrope"),
])
def test_a_megatron_lm_model_the_driver_does_not_build_is_refused(tmp_path, refused, override, shown):
    root = megatron_lm_checkpoint(tmp_path / "ckpt", megatron_lm_args(**override))
    message = refused(["--load", str(root), "--use-checkpoint-args", *RUN])
    assert message.startswith(f"checkpoint {root / f'iter_{ITERATION:07d}'} was saved by Megatron-LM with {shown}")


def test_every_layer_moe_spelled_as_a_list_is_accepted(tmp_path):
    root = megatron_lm_checkpoint(tmp_path / "ckpt", megatron_lm_args(moe_layer_freq=[1, 1, 1, 1]))
    assert checkpointing.saved_args(str(root))["num_experts"] == 8


def test_args_of_neither_kind_are_refused_naming_the_checkpoint(tmp_path, refused):
    root = megatron_lm_checkpoint(tmp_path / "ckpt", megatron_lm_args())
    path = root / f"iter_{ITERATION:07d}"
    torch.save({"args": None, "iteration": ITERATION}, path / "common.pt")
    assert refused(["--load", str(root), "--use-checkpoint-args", *RUN]) == (
        f"{path} holds no saved args (a checkpoint of neither pretrain_gpt.py nor Megatron-LM); point --load at "
        "one of theirs, or drop --use-checkpoint-args")
