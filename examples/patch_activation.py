"""Activation patching: where does the model carry the attribute names it copies?

    python examples/patch_activation.py

In a constructor, the next attribute is often one assigned just before: after
``self.width = width; self.height = height; self.`` the bundled code model
predicts ``height``, after ``self.name = name; self.value = value; self.`` it
predicts ``value``.  For each layer, the residual stream at the last position
of the "clean" run is copied into the "corrupt" run (run_with_hooks), and the
logit difference between the two answers shows how much of the clean
prediction that one vector brings back.  Uses the bundled model only.
"""

import cyformer

CLEAN = "        self.width = width\n        self.height = height\n        self."
CORRUPT = "        self.name = name\n        self.value = value\n        self."


def main():
    model = cyformer.load()
    clean, corrupt = model.encode(CLEAN), model.encode(CORRUPT)
    assert len(clean) == len(corrupt), "the prompts must tokenize to the same length"
    names = [f"blocks.{i}.hook_resid_post" for i in range(model.config.n_layer)]
    clean_logits, cache = model.run_with_cache(clean, names=names)
    corrupt_logits = model.forward(corrupt)
    good, bad = int(clean_logits[-1].argmax()), int(corrupt_logits[-1].argmax())

    def diff(logits):  # > 0: the clean answer wins
        return float(logits[-1, good] - logits[-1, bad])

    d_clean, d_corrupt = diff(clean_logits), diff(corrupt_logits)
    print(f"clean answer {model.decode([good])!r}, corrupt answer {model.decode([bad])!r}")
    print(f"logit difference: clean {d_clean:+.2f}, corrupt {d_corrupt:+.2f}")
    for name in names:
        def patch(resid, hook_name, src=cache[name]):
            out = resid.copy()
            out[-1] = src[-1]  # the last position's residual stream, from the clean run
            return out
        d = diff(model.run_with_hooks(corrupt, fwd_hooks=[(name, patch)]))
        print(f"{name:28s} patched: {d:+.2f}  ({(d - d_corrupt) / (d_clean - d_corrupt):.0%} restored)")


if __name__ == "__main__":
    main()
