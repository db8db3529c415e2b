"""`python -m drafthead.train` and `accelerate launch -m drafthead.train --config ...`."""
import sys

from drafthead.commands.train import main

sys.exit(main())
