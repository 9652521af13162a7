"""What a model is trained to do: one module per objective, behind one interface (base.py), picked by the registry.

    from llmops.objectives import selected
    objective = selected(config.data)      # the objective the config selects, bound to its record kind
    objective.kind.canonical(row, columns) # what the data stages ask of the record kind
    objective.encode(tokenizer, rows, encoding), objective.score(model, tokenizer, rows, context), ...

`load_config` reads a config file and completes and checks it for its objective.
"""

from llmops.objectives.config import handing, load_config
from llmops.objectives.registry import record_kind, selected

__all__ = ["handing", "load_config", "record_kind", "selected"]
