"""Small self-contained helpers for demos and end-to-end tests (tiny test model)."""
