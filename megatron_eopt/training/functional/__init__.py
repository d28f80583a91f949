"""Functional-test cases in Megatron-LM's schema, and their golden values (docs/functional-tests.md)."""
