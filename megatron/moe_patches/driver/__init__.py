"""The pretraining driver behind ``pretrain_gpt.py``; patch modules never import it.

``arguments`` (pretrain_gpt.py's parsing, the checks of the settings together and the config
from them), ``parser`` (its parser), the checks by what they judge (``given_values``,
``launcher_env``, ``load_check``, ``data_files``, ``output_dirs``, ``config_refusals``),
``patch_args`` (the patch flags generated from the fields), ``recipes`` (``--yaml-cfg``),
``checkpointing`` (torch_dist checkpoints), ``training`` (the loop and ``main``),
``iteration_log`` (its log line), ``functional`` (the functional-test runner),
``builtin_recipes``, ``cli`` (the ``megatron-moe-pretrain`` command) and ``compat`` (what the
imported megatron-core offers: 0.16.1 with the patch set, or a version with its features
natively). Imports go one way: cli -> training -> arguments -> the checks -> parser ->
patch_args; load_check -> checkpointing; training -> iteration_log; arguments -> recipes;
training, arguments, checkpointing -> compat.
Bad input is refused in ``arguments.parse_args``, before any CUDA or NCCL work.
"""
