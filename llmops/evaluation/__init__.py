"""The evaluate stage. In the stage keys."""
