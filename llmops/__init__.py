"""llmops: turn a dataset into a trained, evaluated and registered language model, and keep doing it."""
