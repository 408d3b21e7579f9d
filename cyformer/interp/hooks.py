"""The hook points live in cyformer.hooks (the forward pass needs them);
re-exported here for analysis code."""

from ..hooks import (ActivationCache, HookPoints, block_points, concat_steps, hook_names,  # noqa: F401
                     position_axis, select, stack_batch)
