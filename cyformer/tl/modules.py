"""The module tree TransformerLens code walks: ``model.blocks[4].attn.hook_z``,
``model.blocks[0].attn.W_Q``, ``model.unembed.b_U``, ``model.embed.W_E``.

Each node holds the hook points of its part (the wrapper's HookPoints, so
``add_hook`` on one here is ``add_hook`` on the model) and reads its weights
from the wrapper's stacked ones (``blocks[i].attn.W_Q`` is ``W_Q[i]``).
Bridge-style names (``hook_in``, ``q.hook_out``) reach the same points.
"""


class Node:
    """A named part: attributes are hook points, weights or child parts."""

    def __init__(self, lens, prefix, weights=None):
        self._lens, self._prefix = lens, prefix
        self._weights = weights or {}  # attribute -> (stacked name, layer or None)

    def __repr__(self):
        return f"<{type(self).__name__} {self._prefix.rstrip('.') or 'model'}>"

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._weights:
            stacked, layer = self._weights[name]
            w = getattr(self._lens, stacked)
            return w if layer is None or w is None else w[layer]
        if name.startswith("hook_"):
            points = self._lens.hook_dict
            full = self._prefix + name
            if full in points:
                return points[full]
        raise AttributeError(f"{self!r} has no attribute {name!r}")


class Attention(Node):
    def __init__(self, lens, i):
        names = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "QK", "OV")
        super().__init__(lens, f"blocks.{i}.attn.", {n: (n, i) for n in names})
        for part in ("q", "k", "v", "o", "qkv"):
            setattr(self, part, Node(lens, f"blocks.{i}.attn.{part}."))


class MLP(Node):
    def __init__(self, lens, i):
        names = ("W_in", "b_in", "W_gate", "W_out", "b_out")
        super().__init__(lens, f"blocks.{i}.mlp.", {n: (n, i) for n in names})
        for part in ("in", "out", "gate"):
            setattr(self, part, Node(lens, f"blocks.{i}.mlp.{part}."))


class Block(Node):
    def __init__(self, lens, i):
        super().__init__(lens, f"blocks.{i}.")
        self.layer = i
        self.attn = Attention(lens, i)
        self.mlp = MLP(lens, i)
        self.ln1 = Node(lens, f"blocks.{i}.ln1.", {"w": ("ln1_w", i), "b": ("ln1_b", i)})
        self.ln2 = Node(lens, f"blocks.{i}.ln2.", {"w": ("ln2_w", i), "b": ("ln2_b", i)})


def tree(lens):
    """name -> node of the top level: blocks, embed, pos_embed, ln_final, unembed."""
    L = lens.model.config.n_layer
    return {
        "blocks": [Block(lens, i) for i in range(L)],
        "embed": Node(lens, "embed.", {"W_E": ("W_E", None)}),
        "pos_embed": Node(lens, "pos_embed.", {"W_pos": ("W_pos", None)}),
        "ln_final": Node(lens, "ln_final.", {"w": ("ln_final_w", None), "b": ("ln_final_b", None)}),
        "unembed": Node(lens, "unembed.", {"W_U": ("W_U", None), "b_U": ("b_U", None)}),
    }
