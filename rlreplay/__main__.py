"""``python -m rlreplay``: the command line."""

import sys

from rlreplay.cli.main import main

sys.exit(main())
