"""Predict: a registered version's answers for JSONL rows, the way its evaluation scored it.

A version is named `NAME` (its champion), `NAME@alias` or `NAME/VERSION` and loaded through the
MLflow registry. Each input row is one of the shapes the pipeline ingests, and its shape says what
is asked of the model:

- `instruction` (optional `input`), or `messages` (ShareGPT `conversations` too): the model's
  reply, generated greedily through its chat template; an `output`, or a closing assistant turn,
  is the reference answer: left out of the prompt and echoed back next to the reply;
- `text`, to a classifier: the label and the probability of every label;
- `tokens` (a list of words), or `text` split on whitespace, to a tagger: each word's tag and the entities
  (type, words, start and end word index, end exclusive);
- `text`, to a language model: its perplexity, on the tokens evaluation would have scored;
- `text` holding the model's mask token (or `[MASK]`), to a masked LM: the top fills of each masked
  position with their probabilities;
- `source` (or `input`, `document`, `article`, `question`, `text`, as ingest maps them), to a
  sequence-to-sequence model: its greedy target; a `target` (or `output`, `summary`, ...) is the
  reference, echoed back next to it.

Lengths follow the version's own run: texts are cut at its `tokenize.max_length`, replies at its
`evaluate.max_new_tokens`. A row that cannot be read or has no usable shape becomes an error row
with its line number: nothing is dropped.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmops.core import tracking
from llmops.core.config import EvaluateConfig, TokenizeConfig, TrackingConfig
from llmops.data.ingest import SHAREGPT_ROLES, parse_object
from llmops.data.tokenize import IGNORE_INDEX
from llmops.models import modeling
from llmops.objectives import masked_lm, seq2seq, token_classification
from llmops.text.templates import Messages, prompt_messages, render

Task = Literal["generate", "perplexity", "classify", "tag", "fill_mask", "seq2seq"]
ROLES = ("system", "user", "assistant")
# what a run records about itself, read back to predict the way evaluation did
RESOLVED_CONFIG = "config/resolved.yaml"
EXCERPT_CHARS = 80


class PredictError(ValueError):
    """The model reference cannot be resolved or loaded; the message is one line a person can act on."""


class RowError(ValueError):
    """One input row cannot be predicted on; the message says why."""


@dataclass(frozen=True)
class Reference:
    """A registered model: by alias, or by version number."""

    name: str
    alias: str | None = None
    version: str | None = None

    @property
    def uri(self) -> str:
        return f"models:/{self.name}@{self.alias}" if self.alias else f"models:/{self.name}/{self.version}"

    def __str__(self) -> str:
        return f"{self.name}@{self.alias}" if self.alias else f"{self.name}/{self.version}"


def parse_reference(text: str) -> Reference:
    """`NAME`, `NAME@alias` or `NAME/VERSION`; a bare name means its champion."""
    name, at, alias = text.partition("@")
    if at:
        if not name or not alias:
            raise PredictError(f"{text!r}: expected NAME, NAME@alias or NAME/VERSION")
        return Reference(name=name, alias=alias)
    numbered = re.fullmatch(r"(.+)/(\d+)", text)
    if numbered:
        return Reference(name=numbered.group(1), version=numbered.group(2))
    if not text.strip():
        raise PredictError("no model named: expected NAME, NAME@alias or NAME/VERSION")
    return Reference(name=text, alias="champion")


@dataclass
class Predictor:
    """A loaded version and how its run tokenized and generated."""

    name: str
    version: str
    model: Any
    tokenizer: Any
    labels: list[str] | None  # a classifier's labels in output order; None for a language model
    max_length: int
    max_new_tokens: int
    # the MLflow pipeline task it was registered with (text-generation, token-classification, fill-mask, ...)
    task: str = ""

    @property
    def device(self) -> str:
        return str(self.model.device)

    @property
    def limits(self) -> str:
        cut = f"texts cut at {self.max_length} tokens"
        if self.task == "fill-mask":
            marks = f"{self.tokenizer.mask_token} or {masked_lm.MASK_PLACEHOLDER}"
            return f"top {masked_lm.TOP_K} fills of each {marks}, {cut}"
        return cut if self.labels is not None else f"replies of up to {self.max_new_tokens} tokens, {cut}"


def resolve_version(mlflow_client: Any, reference: Reference, where: str) -> Any:
    """The registered version the reference names, or a one-line error saying what exists instead."""
    from mlflow.exceptions import MlflowException

    try:
        if reference.alias:
            return mlflow_client.get_model_version_by_alias(reference.name, reference.alias)
        return mlflow_client.get_model_version(reference.name, reference.version)
    except MlflowException:
        pass
    known = [model.name for model in mlflow_client.search_registered_models()]
    if reference.name not in known:
        listed = ", ".join(sorted(known)) or "none"
        raise PredictError(f"no registered model {reference.name!r} in {where} (registered models: {listed})")
    if reference.alias:
        aliases = mlflow_client.get_registered_model(reference.name).aliases or {}
        listed = ", ".join(f"@{alias} (version {number})" for alias, number in sorted(aliases.items())) or "none"
        raise PredictError(f"{reference.name} has no alias {reference.alias!r} (aliases: {listed})")
    versions = sorted(int(v.version) for v in mlflow_client.search_model_versions(f"name = '{reference.name}'"))
    raise PredictError(f"{reference.name} has no version {reference.version} (versions: "
                       f"{', '.join(map(str, versions))})")


def run_config(mlflow_client: Any, run_id: str | None) -> dict[str, Any]:
    """The resolved pipeline config of the run that registered the version; {} when there is none."""
    if not run_id:
        return {}
    import yaml
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as folder:
        try:
            path = mlflow_client.download_artifacts(run_id, RESOLVED_CONFIG, folder)
        except (MlflowException, OSError):
            return {}
        return yaml.safe_load(Path(path).read_text()) or {}


def masked(uri: str) -> str:
    """A store's URI without the password it may carry."""
    return re.sub(r"//[^/@]+@", "//***@", uri)


def load(reference: Reference, tracking_config: TrackingConfig) -> Predictor:
    """Resolve the reference in the registry, load the version's weights and tokenizer, and place them."""
    from mlflow.exceptions import MlflowException

    mlflow_client = tracking.client(tracking_config)
    version = resolve_version(mlflow_client, reference, masked(tracking.tracking_uri(tracking_config)))
    settings = run_config(mlflow_client, version.run_id)
    labels = settings.get("data", {}).get("labels") or []
    uri = f"models:/{version.name}/{version.version}"
    try:
        with tempfile.TemporaryDirectory() as folder:
            model, tokenizer, task = load_components(uri, Path(folder), labels)
    except (OSError, MlflowException) as err:  # e.g. a LoRA version whose base model folder has moved
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise PredictError(f"{reference} ({uri}) cannot be loaded: {first_line}") from None
    is_classifier = task == "text-classification"
    if is_classifier and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id  # classifiers find each row's last token by it
    labelled = is_classifier or task == token_classification.PIPELINE_TASK
    return Predictor(name=version.name, version=str(version.version), model=modeling.place(model).eval(),
                     tokenizer=tokenizer, labels=class_labels(model) if labelled else None, task=task,
                     max_length=int(settings.get("tokenize", {}).get("max_length") or
                                    TokenizeConfig().max_length),
                     max_new_tokens=int(settings.get("evaluate", {}).get("max_new_tokens") or
                                        EvaluateConfig().max_new_tokens))


def modeling_base(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper, or the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def class_labels(model: Any) -> list[str]:
    id2label = modeling_base(model).config.id2label
    return [str(id2label[index]) for index in sorted(id2label, key=int)]


def load_components(uri: str, folder: Path, labels: list[str]) -> tuple[Any, Any, str]:
    """Weights, tokenizer and pipeline task of a registered version, downloaded through the registry.

    MLflow rebuilds a LoRA version on its base model, but builds a classifier's base with a default
    two-label head, which the adapter's head does not fit: those load with the run's label set.
    """
    import mlflow
    import yaml

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(folder)))
    flavor = (yaml.safe_load((local / "MLmodel").read_text()).get("flavors") or {}).get("transformers")
    if flavor is None:
        raise PredictError(f"{uri} is not a transformers model; predict loads the versions the pipeline registers")
    if flavor.get("peft_adaptor") and flavor.get("task") in ("text-classification", "token-classification"):
        return *adapter_classifier(local, flavor, labels), flavor["task"]
    components = mlflow.transformers.load_model(str(local), return_type="components")
    return components["model"], components["tokenizer"], flavor.get("task", "")


def adapter_classifier(local: Path, flavor: dict[str, Any], labels: list[str]) -> tuple[Any, Any]:
    from peft import AutoPeftModelForSequenceClassification, AutoPeftModelForTokenClassification
    from transformers import AutoTokenizer

    if not labels:
        raise PredictError("this LoRA classifier's run records no label set (data.labels): its head cannot be "
                           "rebuilt")
    auto = AutoPeftModelForTokenClassification if flavor["task"] == token_classification.PIPELINE_TASK else \
        AutoPeftModelForSequenceClassification
    model = auto.from_pretrained(str(local / flavor["peft_adaptor"]), **modeling.label_maps(labels))
    return model, AutoTokenizer.from_pretrained(str(local / "components" / "tokenizer"))


# --- input rows --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One readable input row: what to ask of the model, and a reference answer if the row carries one."""

    line: int
    task: Task
    text: str = ""
    prompt: tuple[dict[str, str], ...] = ()
    reference: str | None = None
    words: tuple[str, ...] = ()


def read_request(line: int, raw: bytes, classifier: bool, *, tagger: bool = False, mask_token: str | None = None,
                 transduces: bool = False) -> Request:
    """Parse one JSONL line into a request; RowError says what is wrong with it. A masked LM (its mask token
    given) fills the masked positions of `text`; a seq2seq model (transduces) writes a target for a source."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RowError(f"invalid UTF-8 at byte {err.start}") from None
    row, problem = parse_object(text)
    if row is None:
        raise RowError(f"{problem.code.value}: {problem.message}" if problem else "not a JSON object")
    if tagger:
        try:
            return Request(line=line, task="tag", words=tuple(token_classification.request_words(row)))
        except ValueError as err:
            raise RowError(str(err)) from None
    if classifier:
        return Request(line=line, task="classify", text=string_field(row, "text"))
    if mask_token is not None:
        try:
            return Request(line=line, task="fill_mask", text=masked_lm.request_text(string_field(row, "text"),
                                                                                    mask_token))
        except masked_lm.NoMaskError as err:
            raise RowError(str(err)) from None
    if transduces:
        return source_request(line, row)
    if "messages" in row or "conversations" in row:
        prompt, reference = chat_prompt(row.get("messages", row.get("conversations")))
        return Request(line=line, task="generate", prompt=tuple(prompt), reference=reference)
    if "instruction" in row:
        fields = {"instruction": string_field(row, "instruction"),
                  "input": string_field(row, "input", required=False)}
        return Request(line=line, task="generate", prompt=tuple(prompt_messages(fields)),
                       reference=string_field(row, "output", required=False))
    if "text" in row:
        return Request(line=line, task="perplexity", text=string_field(row, "text"))
    raise RowError("expected a field instruction (with optional input and output), messages or text; got "
                   f"{', '.join(sorted(row)) or 'an empty object'}")


def source_request(line: int, row: dict[str, Any]) -> Request:
    """A row for a sequence-to-sequence model: its source, and its target as the reference."""
    source, target = seq2seq.request_columns(row)
    if source is None:
        given = ", ".join(sorted(row)) or "an empty object"
        raise RowError(f"expected a source field ({', '.join(seq2seq.SOURCE_COLUMNS)}), with an optional "
                       f"reference ({', '.join(seq2seq.TARGET_COLUMNS)}); got {given}")
    return Request(line=line, task="seq2seq", text=string_field(row, source),
                   reference=string_field(row, target, required=False) if target else None)


def string_field(row: dict[str, Any], name: str, required: bool = True) -> str | None:
    value = row.get(name)
    if value is None and not required:
        return None
    if value is None:
        raise RowError(f"{name}: missing (expected a string)")
    if not isinstance(value, str):
        raise RowError(f"{name}: expected a string, got {type(value).__name__}")
    if required and not value.strip():
        raise RowError(f"{name}: empty or only whitespace")
    return value


def chat_prompt(turns: Any) -> tuple[Messages, str | None]:
    """The turns to reply to, and the closing assistant turn as the reference when there is one."""
    if not isinstance(turns, list) or not turns:
        raise RowError("messages: expected a non-empty list of {role, content} turns")
    messages: Messages = []
    for number, turn in enumerate(turns, 1):
        if isinstance(turn, dict) and "from" in turn and "role" not in turn:
            turn = {"role": SHAREGPT_ROLES.get(str(turn["from"]).lower(), turn["from"]), "content": turn.get("value")}
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise RowError(f"messages: turn {number} is not a {{role: {'|'.join(ROLES)}, content: string}}")
        messages.append({"role": turn["role"], "content": turn["content"]})
    reference = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
    if not messages or messages[-1]["role"] != "user":
        raise RowError("messages: the prompt must end with a user turn (a closing assistant turn is the reference)")
    return messages, reference


# --- batches -----------------------------------------------------------------------------------------------


def predict_lines(predictor: Predictor, lines: Iterable[bytes], batch_size: int) -> Iterator[dict[str, Any]]:
    """One result per non-blank input line, in input order: a prediction, or the line's error."""
    pending: list[tuple[int, bytes]] = []
    for number, raw in enumerate(lines, 1):
        raw = raw.rstrip(b"\r\n")
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if not raw.strip():
            continue
        pending.append((number, raw))
        if len(pending) == batch_size:
            yield from predict_batch(predictor, pending)
            pending = []
    if pending:
        yield from predict_batch(predictor, pending)


def predict_batch(predictor: Predictor, lines: list[tuple[int, bytes]]) -> list[dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    requests: dict[Task, list[Request]] = {task: [] for task in TASKS}
    tagger = predictor.task == token_classification.PIPELINE_TASK
    mask_token = predictor.tokenizer.mask_token if predictor.task == "fill-mask" else None
    transduces = predictor.task == seq2seq.TASK
    for number, raw in lines:
        try:
            request = read_request(number, raw, predictor.labels is not None, tagger=tagger, mask_token=mask_token,
                                   transduces=transduces)
        except RowError as err:
            results[number] = {"line": number, "error": str(err), "excerpt": excerpt(raw)}
            continue
        requests[request.task].append(request)
    for task, batch in requests.items():
        if batch:
            for request, answer in zip(batch, TASKS[task](predictor, batch), strict=True):
                results[request.line] = {"line": request.line, **answer}
    return [results[number] for number, _ in lines]


def excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "…"


def generate(predictor: Predictor, requests: list[Request]) -> list[dict[str, Any]]:
    """Greedy replies through the chat template, batched with left padding (as evaluation generates)."""
    import torch

    tokenizer = predictor.tokenizer
    tokenizer.padding_side = "left"
    prompts = [render(tokenizer, list(request.prompt), generation_prompt=True) for request in requests]
    batch = modeling.on_device(tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False),
                               predictor.model)
    with torch.no_grad():
        generated = predictor.model.generate(**batch, max_new_tokens=predictor.max_new_tokens, do_sample=False,
                                             eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.pad_token_id)
    replies = tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return [{"output": reply.strip(), **({"reference": request.reference} if request.reference is not None else {})}
            for request, reply in zip(requests, replies, strict=True)]


def encode_texts(predictor: Predictor, requests: list[Request], eos: bool) -> tuple[dict[str, Any], list[bool]]:
    """Token ids as the tokenize stage makes them (special tokens, EOS for language modelling), cut at the
    run's max_length and right-padded; and whether each row was cut."""
    tokenizer = predictor.tokenizer
    ids = tokenizer([request.text for request in requests], add_special_tokens=True)["input_ids"]
    ids = [seq + [tokenizer.eos_token_id] if eos else seq for seq in ids]
    cut = [len(seq) > predictor.max_length for seq in ids]
    tokenizer.padding_side = "right"
    batch = tokenizer.pad({"input_ids": [seq[:predictor.max_length] for seq in ids]}, return_tensors="pt")
    return modeling.on_device(dict(batch), predictor.model), cut


def perplexity(predictor: Predictor, requests: list[Request]) -> list[dict[str, Any]]:
    """exp of each row's mean negative log-likelihood per predicted token."""
    import torch

    batch, cut = encode_texts(predictor, requests, eos=True)
    with torch.no_grad():
        logits = predictor.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE_INDEX)
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets,
                                               ignore_index=IGNORE_INDEX, reduction="none").sum(-1)
    counts = (targets != IGNORE_INDEX).sum(-1)
    return [{"perplexity": math.exp(loss / count) if count else math.nan, "tokens": int(count), "truncated": was_cut}
            for loss, count, was_cut in zip(losses.tolist(), counts.tolist(), cut, strict=True)]


def classify(predictor: Predictor, requests: list[Request]) -> list[dict[str, Any]]:
    """The most probable label and the probability of each label."""
    import torch

    batch, cut = encode_texts(predictor, requests, eos=False)
    with torch.no_grad():
        probabilities = predictor.model(**batch).logits.float().softmax(-1).tolist()
    labels = predictor.labels or []
    return [{"label": labels[max(range(len(row)), key=row.__getitem__)],
             "scores": dict(zip(labels, row, strict=True)), "truncated": was_cut}
            for row, was_cut in zip(probabilities, cut, strict=True)]


def tag(predictor: Predictor, requests: list[Request]) -> list[dict[str, Any]]:
    """Each word's tag and the entities they form, as evaluation tagged them."""
    return token_classification.answers(predictor.model, predictor.tokenizer, [list(r.words) for r in requests],
                                        predictor.labels or [], predictor.max_length)


def fill_mask(predictor: Predictor, requests: list[Request]) -> list[dict[str, Any]]:
    """The top fills of each masked position, with probabilities, and the text with the best fills."""
    return masked_lm.fill(predictor.model, predictor.tokenizer, [request.text for request in requests],
                          predictor.max_length)


def transduce(predictor: Predictor, requests: list[Request]) -> list[dict[str, Any]]:
    """Greedy targets for the sources, as evaluation generated them; the reference, when given, beside each."""
    answers = seq2seq.answer(predictor.model, predictor.tokenizer, [request.text for request in requests],
                             predictor.max_length, predictor.max_new_tokens)
    return [{**answer, **({"reference": request.reference} if request.reference is not None else {})}
            for request, answer in zip(requests, answers, strict=True)]


TASKS = {"generate": generate, "perplexity": perplexity, "classify": classify, "tag": tag, "fill_mask": fill_mask,
         "seq2seq": transduce}


def dump(result: dict[str, Any]) -> str:
    """One JSON line; a perplexity that overflowed is written as null rather than invalid JSON."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in result.items()},
                      ensure_ascii=False)
