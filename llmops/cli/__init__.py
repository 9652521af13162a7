"""The llmops command. Out of the stage keys: no stage runs it."""
