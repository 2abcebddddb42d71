"""Command-line tools built on the public APIs of ``ftsdp`` and ``storage``."""
