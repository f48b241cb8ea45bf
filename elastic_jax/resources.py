"""Where the package's shipped files are: its folder, the run configs (inside the package when
installed from a wheel, the repository's configs/ in a source checkout)."""

from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))   # elastic_jax/
CONFIGS_DIR = next((d for d in (os.path.join(PACKAGE_DIR, "configs"),
                                os.path.join(os.path.dirname(PACKAGE_DIR), "configs"))
                    if os.path.isdir(d)), os.path.join(PACKAGE_DIR, "configs"))
