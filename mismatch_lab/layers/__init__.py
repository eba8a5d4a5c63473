"""`mismatch-lab layers`: where along the network the low-precision model leaves the fp32 one.

metrics.py holds the math (numpy, shapes in the docstrings), hooks.py finds the modules of a transformers
model and captures their outputs, measure.py runs both models on the same tokens, command.py is the CLI.
docs/layers.md states every definition.
"""
