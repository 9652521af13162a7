"""The stage table, its runner (what the flow's tasks, `llmops stage` and dvc repro call), keys, dvc.yaml, the worker
pool (local or Ray), a sweep's space and its Optuna study, whether a run would change nothing. Out of the stage keys:
it moves, records or schedules bytes, never shapes them.
"""
