"""One module per pipeline stage, plus the helpers they share."""
