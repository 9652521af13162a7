"""The stage table, keys, the worker pool (local or Ray), sweeps. Out of the stage keys: it moves, records or schedules
bytes, never shapes them.
"""
