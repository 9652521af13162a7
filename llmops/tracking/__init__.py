"""MLflow runs, logging, cost, sweep trials and a sweep's parent and child runs. Out of the stage keys: it moves,
records or schedules bytes, never shapes them.
"""
