"""The one pydantic config tree and how it is read. In the stage keys by the values a stage reads, not by its code."""
