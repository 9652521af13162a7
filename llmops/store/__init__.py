"""The workspace, its artifacts, the shared store and its settings. Out of the stage keys: it moves, records or
schedules bytes, never shapes them.
"""
