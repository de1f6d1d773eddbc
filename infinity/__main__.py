"""`python -m infinity` is the `infinity` command."""

import sys

from infinity.cli import console_main

sys.exit(console_main())
