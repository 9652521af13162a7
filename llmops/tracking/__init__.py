"""MLflow runs, logging, cost, sweep trials. Out of the stage keys: it moves, records or schedules bytes, never shapes
them.
"""
