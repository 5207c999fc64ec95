"""`python -m memspec ...`: the `memspec` command line, for an environment whose scripts folder is
not on PATH."""

import sys

from memspec.cli import main

sys.exit(main())
