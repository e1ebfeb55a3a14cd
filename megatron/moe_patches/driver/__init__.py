"""The pretraining driver behind ``pretrain_gpt.py``; patch modules never import it.

``arguments`` (pretrain_gpt.py's flags and checks), ``patch_args`` (the patch flags
generated from the fields), ``recipes`` (``--yaml-cfg``), ``checkpointing`` (torch_dist
checkpoints), ``training`` (the loop and ``main``), ``functional`` (the functional-test
runner). Imports go one way: training -> arguments, checkpointing -> patch_args.
"""
