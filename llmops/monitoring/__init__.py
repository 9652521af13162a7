"""Monitoring: what the service answered, how fast and how well, whether its inputs drift, and rated requests
turned into rows of the pipeline's own kinds. Not in the stage keys."""
