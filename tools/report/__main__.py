"""``python -m ftsdp.tools.report ...``: the same as the ``ftsdp-report`` console script."""

import sys

from ftsdp.tools.report import main

sys.exit(main())
