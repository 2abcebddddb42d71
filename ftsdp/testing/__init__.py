"""ftsdp.testing: test-only machinery; the product never imports it.

- Fault injection (``FTSDP_FAULT``) at the training loop's step boundaries, and the ``faulty://``
  filesystem that dies at chosen points of a checkpoint commit.
"""
