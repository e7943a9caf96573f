"""One registry class for everything selected by name: losses, advantage estimators, KL
estimators and aggregation modes.

A registered function takes a fixed number of positional arrays (the registry's ``arguments``)
followed by its *options*: keyword parameters with defaults, passed through by name from the
configuration (``rl.loss_options``, ``rl.advantage_options``; ``ENTRY:NAME=VALUE`` only when
``ENTRY`` is the one selected). An option the function does not take is an error that lists the
ones it does take, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Mapping


class Registry:
    """Functions of one kind (``kind`` names it in errors) registered by name."""

    def __init__(self, kind: str, arguments: tuple[str, ...]):
        self.kind = kind
        self.arguments = arguments  # the fixed positional parameters every entry takes
        self._entries: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[Callable], Callable]:
        """Decorator registering ``fn(*arguments, **options)`` under ``name``."""

        def wrap(fn: Callable) -> Callable:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            params = list(inspect.signature(fn).parameters.values())
            positional = [
                p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
            ]
            if len(positional) != len(self.arguments):
                raise TypeError(
                    f"{self.kind} {name!r}: takes {[p.name for p in positional]} without defaults; "
                    f"a {self.kind} takes exactly {list(self.arguments)} (then options with defaults)"
                )
            self._entries[name] = fn
            return fn

        return wrap

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {self.names()}") from None

    def options(self, name: str) -> dict[str, Any]:
        """The options ``name`` takes, with their defaults (``None`` for ``**kwargs``-style entries)."""
        params = list(inspect.signature(self.get(name)).parameters.values())[len(self.arguments) :]
        return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def check_options(self, name: str, options: Mapping[str, Any], field: str = "") -> None:
        """Raise ``ValueError`` (naming ``field``) for an option ``name`` does not take."""
        fn = self.get(name)
        if any(p.kind == p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
            return
        accepted = self.options(name)
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            takes = ", ".join(f"{k}={v!r}" for k, v in accepted.items()) or "no options"
            where = f"{field}: " if field else ""
            raise ValueError(f"{where}{self.kind} {name!r} does not take {unknown}; it takes {takes}")

    def __call__(self, name: str, *arguments, **options):
        """Call the entry ``name`` after checking its options."""
        self.check_options(name, options)
        return self.get(name)(*arguments, **options)

    @contextlib.contextmanager
    def restoring(self) -> Iterator["Registry"]:
        """Registrations made inside the block are undone when it ends (tests, notebooks)."""
        saved = dict(self._entries)
        try:
            yield self
        finally:
            self._entries.clear()
            self._entries.update(saved)


def parse_options(
    text: str, field: str, registry: "Registry | None" = None, selected: str | None = None
) -> dict[str, Any]:
    """``"clip_high=0.28,clip_dual=None"`` -> ``{"clip_high": 0.28, "clip_dual": None}``.

    Values are Python literals (numbers, ``None``, ``True``, quoted strings); anything else is
    kept as a string (``scale=batch``). Errors name ``field``.

    ``ENTRY:NAME=VALUE`` scopes an option to one registered entry: it applies only when ``selected``
    is ``ENTRY`` (``"grpo:scale=batch"`` gives GRPO the batch std, and selecting ``rloo`` instead
    is not an error). The scope must be an entry of ``registry``, so a misspelt one is an error."""
    import ast

    options: dict[str, Any] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        scope, colon, name = key.rpartition(":")
        scope, name = scope.strip(), name.strip()
        if not sep or not name.isidentifier() or (colon and not scope):
            raise ValueError(f"{field}: {item!r} must be NAME=VALUE or ENTRY:NAME=VALUE")
        if colon:
            if registry is None or selected is None:
                raise ValueError(f"{field}: {item!r}: scoped options (ENTRY:NAME=VALUE) need a selected entry")
            if scope not in registry:
                raise ValueError(
                    f"{field}: {item!r} is scoped to {scope!r}, which is not a registered {registry.kind}; "
                    f"registered: {registry.names()}"
                )
            if scope != selected:
                continue
        if name in options:
            raise ValueError(f"{field}: option {name!r} given twice")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[name] = value
    return options
