"""Record kinds: the shape of a record, the columns public datasets give its fields, its checks, what dedup compares,
and the chat turns conversational records make. What the data stages need of a record; which kind a config reads,
and what is trained on it, the objectives decide (objectives/registry.py).
"""
