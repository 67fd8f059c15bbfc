"""`python -m sparserl_jax train|generate CONFIG [key=value ...]`, the same as `sparserl`."""

import sys

from sparserl_jax.cli import main

sys.exit(main())
