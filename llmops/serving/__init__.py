"""Predict and serve. Out of the stage keys: no stage runs it."""
