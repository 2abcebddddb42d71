"""Kept only for ``free_port``'s importers (tests/s3_fixture.py, tests/e2e/test_faults_node_loss.py):
the rank spawner is ``ftsdp.testing.run_ranks``. Import from ``ftsdp.testing`` and delete this."""

from ftsdp.testing import free_port

__all__ = ["free_port"]
