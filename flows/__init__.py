"""Flows, the CLI and config loading: wiring only; the work lives in `tasks`."""
