"""The model's parts live in cyformer.parts (the Model hands them out);
re-exported here for analysis code."""

from ..parts import (Attention, Block, FactoredMatrix, Head, LayerNorm, MLP, Neuron,  # noqa: F401
                     Neurons, Unembed, model_blocks)
