"""`python -m infinity` is the `infinity` command."""

import sys

from infinity.cli import main

sys.exit(main())
