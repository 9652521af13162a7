"""User errors, files and their hashes, shards, tables, rejects, a stage's figures. In the stage keys."""
