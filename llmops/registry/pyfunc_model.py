"""A version as MLflow's pyfunc serves it, for objectives whose pipeline transformers no longer builds by task.

MLflow loads this file as the model's code (models from code) with the package beside it; it ends by
naming the model. `predict` takes a list of rows as `llmops predict` reads them (MLflow checks
the list against the type hint; a REST client sends `{"inputs": [...]}`) and returns the
objective's answers, one per row: the same code, the same answers. A row that cannot be read
gets an `error`, as in `llmops predict`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow

ARTIFACT = "model"


class ObjectiveModel(mlflow.pyfunc.PythonModel):
    """The registered weights behind their objective's request parsing and answers."""

    def load_context(self, context: Any) -> None:
        from transformers import AutoTokenizer

        from llmops.models import modeling
        from llmops.objectives import registry
        from llmops.objectives.base import Encoding, Served

        settings = context.model_config
        self.objective = registry.objective_for(registry.target_of_name(settings["objective"]), settings["kind"])
        folder = Path(context.artifacts[ARTIFACT])
        model = modeling.place(self.objective.load_trained(folder)).eval()
        self.served = Served(model=model, tokenizer=AutoTokenizer.from_pretrained(str(folder)),
                             labels=list(settings.get("labels") or []) or None,
                             encoding=Encoding(int(settings["max_length"]), tuple(settings.get("labels") or ()),
                                               int(settings["stride"])),
                             max_new_tokens=int(settings["max_new_tokens"]))

    def predict(self, context: Any, model_input: list[dict[str, Any]],
                params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        from llmops.objectives.base import RowError

        rows = [dict(row) for row in model_input]
        answers: list[dict[str, Any]] = [{} for _ in rows]
        requests = []
        for line, row in enumerate(rows, 1):
            try:
                requests.append(self.objective.request(line, row, self.served))
            except RowError as err:
                answers[line - 1] = {"error": str(err)}
        for request, answer in zip(requests, self.objective.answer(self.served, requests), strict=True):
            answers[request.line - 1] = answer
        return answers


mlflow.models.set_model(ObjectiveModel())
