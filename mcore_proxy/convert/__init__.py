"""Apply a selection plan to a checkpoint and write the proxy (prune -> reshard -> write), and verify it."""
