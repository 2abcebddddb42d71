"""``python -m ftsdp.tools.ckpt ...``: the same as the ``ftsdp-ckpt`` console script."""

import sys

from ftsdp.tools.ckpt import main

sys.exit(main())
