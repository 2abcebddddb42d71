"""``python -m tools.ckpt ...``: the same as the ``ftsdp-ckpt`` console script."""

import sys

from tools.ckpt import main

sys.exit(main())
