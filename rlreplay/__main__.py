import sys

from rlreplay.cli.main import main

sys.exit(main())
