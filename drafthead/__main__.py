"""`python -m drafthead ...` and `accelerate launch -m drafthead train --config ...`: the CLI."""

import sys

from drafthead.cli import main

sys.exit(main())
