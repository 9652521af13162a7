"""Prefect flows, deployments, events, sweeps. Out of the stage keys: no stage runs it."""
