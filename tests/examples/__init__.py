"""Tests of the programs in examples/: the payments API, its OpenAPI schema, and the demo."""
