"""Building and loading models. In the stage keys."""
