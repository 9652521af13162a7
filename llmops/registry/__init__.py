"""References, loading, the gate, register, cards, export. Out of the stage keys: no stage runs it."""
