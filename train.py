"""Router training entry point.

Not implemented yet: router training (the Attention Router, the min-max sparsity objective and
the training loop on device meshes) is the next piece of work. Until then this command says so
and exits with status 2; `python -m elastic_jax.demo` runs the conversion walk-through.
"""

import sys

if __name__ == "__main__":
  print("train.py: router training is not implemented yet; run "
        "`python -m elastic_jax.demo` for the conversion-and-logits walk-through",
        file=sys.stderr)
  sys.exit(2)
