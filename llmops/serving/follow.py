"""Following a reference: the version a service answers with, kept on what `NAME@alias` (or `NAME`, its champion)
names in the registry; `NAME/N` never moves.

`poll()` asks the registry which version the alias names now. A new one is loaded beside the one
serving and asked a smoke request (its objective's own example row); only when that answers does it
take new requests. Requests already running keep the version they started with (they hold it), so
none fails or is dropped by the switch. A version that cannot be loaded, or fails its smoke request,
is refused: one line in the service's log and a tag on that registry version, and the old one keeps
serving. A registry that does not answer leaves the service on the version it has, said once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmops.config.schema import TrackingConfig
from llmops.io.errors import first_line
from llmops.registry.references import Reference, parse_reference, resolve_version
from llmops.serving.predict import load
from llmops.store.settings import mask
from llmops.tracking import log as tracking

log = logging.getLogger("llmops.serve")
# the registry tag a refused version gets, with the reason
REFUSED_TAG = "serving.refused"


@dataclass(frozen=True)
class Live:
    """A loaded version and its name as responses carry it (`NAME/N`)."""

    loaded: Any  # registry.loading.LoadedVersion
    label: str
    since: float = field(default_factory=time.time)


def smoke(loaded: Any) -> None:
    """The version answers its objective's example request, or raises saying why not."""
    objective, served = loaded.objective, loaded.served
    request = objective.request(0, objective.request_example(), served)
    answer = objective.answer(served, [request])[0]
    if "error" in answer:
        raise RuntimeError(f"its smoke request failed: {answer['error']}")


class Follower:
    """The version that answers, following the reference's alias (see the module's docstring)."""

    def __init__(self, reference: str, tracking_config: TrackingConfig,
                 loader: Callable[[str, TrackingConfig], Any] = load) -> None:
        self.reference: Reference = parse_reference(reference)
        self.tracking_config = tracking_config
        self.loader = loader
        self.refused: dict[str, str] = {}
        self.registry_down = False
        self.live = self.start()

    def start(self) -> Live:
        loaded = self.loader(str(self.reference), self.tracking_config)
        smoke(loaded)
        return Live(loaded, f"{loaded.name}/{loaded.version}")

    @property
    def follows(self) -> bool:
        return self.reference.version is None

    def target(self) -> str:
        """The version number the reference names in the registry now."""
        client = tracking.client(self.tracking_config)
        where = mask(tracking.tracking_uri(self.tracking_config))
        return str(resolve_version(client, self.reference, where).version)

    def poll(self) -> str | None:
        """Follow the alias once: the line saying what changed (switched, refused, registry lost or back), or None."""
        if not self.follows:
            return None
        try:
            number = self.target()
        except Exception as err:  # the registry's client raises whatever its transport does
            if self.registry_down:
                return None
            self.registry_down = True
            return self.said(f"the registry does not answer ({first_line(err)}); serving {self.live.label} until "
                             "it does", logging.WARNING)
        back = self.registry_down
        self.registry_down = False
        if number == str(self.live.loaded.version) or number in self.refused:
            return self.said(f"the registry answers again; {self.reference} is {self.live.label}") if back else None
        return self.switch(number)

    def switch(self, number: str) -> str:
        label = f"{self.reference.name}/{number}"
        try:
            loaded = self.loader(label, self.tracking_config)
            smoke(loaded)
        except Exception as err:  # whatever loading or answering raised: the old version keeps serving
            reason = first_line(err)
            self.refused[number] = reason
            self.note_refusal(number, reason)
            return self.said(f"{label} ({self.reference}) refused, {self.live.label} keeps serving: {reason}",
                             logging.ERROR)
        previous, self.live = self.live.label, Live(loaded, label)
        return self.said(f"{self.reference} moved: {label} answers new requests (was {previous})")

    def note_refusal(self, number: str, reason: str) -> None:
        """The refusal, on the registry version itself, where whoever promoted it looks."""
        try:
            tracking.client(self.tracking_config).set_model_version_tag(self.reference.name, number, REFUSED_TAG,
                                                                        reason[:4000])
        except Exception as err:  # the note is a courtesy: the log line stands without it
            log.warning("could not tag %s/%s as refused: %s", self.reference.name, number, first_line(err))

    @staticmethod
    def said(line: str, level: int = logging.INFO) -> str:
        log.log(level, "%s", line)
        return line

