"""Fixture builders that write files exactly as each framework's own writer code does (one module per
framework; each cites the file and commit it follows)."""
