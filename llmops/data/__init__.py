"""Ingest, validate, dedup, tokenize, report; readers; data versions and lineage. In the stage keys."""
