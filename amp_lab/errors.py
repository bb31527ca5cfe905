"""Hydra's and OmegaConf's errors (an option listing and search path, a key/type report) as
amp_lab's one line that says what to do: the override, the options or type, the nearest key."""

from __future__ import annotations

import re
from collections.abc import Iterable
from difflib import SequenceMatcher, get_close_matches

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from amp_lab.config import CONF_DIR, schema_fields

_GROUP = re.compile(r"Available options in '([^']+)'")
_NOT_IN_DEFAULTS = re.compile(r"Could not override '([^']+)'\. No match in the defaults list")


def schema_keys() -> dict[str, str]:
    """Every `group.field` (and top-level field) of the schema, with its type as written, less
    its type arguments (`list`, not `list[str]`)."""
    return {key: str(f.type).split("[")[0] for key, f in schema_fields()}


def _likeness(key: str, real: str) -> float:
    """How alike a typed key and a real one are, as the key or as its name alone against the real
    one's whole path: a renamed key often moved its group into its name (checkpoint_every)."""
    name = key.rpartition(".")[2]
    whole, named = (
        SequenceMatcher(None, key, real),
        SequenceMatcher(None, name, real.replace(".", "_")),
    )
    return max(whole.ratio(), named.ratio())


def did_you_mean(key: str, known: Iterable[str] | None = None) -> str:
    """'; did you mean scaler.init_scale?' for the real key (of `known`, the schema's keys) a typed
    one meant, or '': the same name in another group first, else the nearest."""
    keys = list(known or schema_keys())
    if "." in key:  # a group's setting: the groups themselves are no answer
        groups = {k.partition(".")[0] for k in keys if "." in k}
        keys = [k for k in keys if k not in groups]
    name = key.rpartition(".")[2]
    elsewhere = sorted(k for k in keys if k.rpartition(".")[2] == name and k != key)
    if elsewhere:
        return f"; did you mean {' or '.join(elsewhere)}?"
    score, nearest = max(((_likeness(key, k), k) for k in keys), default=(0.0, ""))
    return f"; did you mean {nearest}?" if score >= 0.6 else ""  # difflib's default cutoff


def _options(group: str) -> str:
    return ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))


def null_group(overrides: Iterable[str]) -> str | None:
    """`precision=null` as one line: Hydra answers a group set to null with a bare ValueError
    ('Config group override must be a string or a list') that names neither group nor options."""
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if value == "null" and (CONF_DIR / key).is_dir():
            return f"{override} leaves the {key} group empty; choose one of: {_options(key)}"
    return None


def _missing_option(err: MissingConfigException) -> str:
    found = _GROUP.search(str(err))
    missing = err.missing_cfg_file or ""
    if not found or not err.options:
        return str(err).strip().splitlines()[0]
    group = found.group(1)
    name = missing[len(group) + 1 :] if missing.startswith(group + "/") else missing
    # a prefix counts too: `pitfall=half` means half_model
    close = [o for o in err.options if o.startswith(name)] or get_close_matches(name, err.options)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return (
        f"{group}={name} is not an option of the {group} group; {hint}"
        f"options: {', '.join(err.options)}"
    )


def _bad_value(err: ValidationError) -> str:
    key, message = str(err.full_key), str(err).strip().splitlines()[0]
    choices = getattr(getattr(err, "child_node", None), "enum_type", None)
    if choices is not None:  # a choice field (an Enum of amp_lab/choices.py)
        return f"{key}={err.value!r} is unknown; use one of {', '.join(c.name for c in choices)}"
    value = re.match(r"Value '([^']*)' (of type|is not)", message)
    if value is None:  # e.g. an Enum's "Invalid value 'x', expected one of [...]"
        return f"{key}: {message}"
    return f"{key}={value.group(1)} is not a valid {schema_keys().get(key, 'value')}"


def one_line(err: BaseException) -> str:
    """The error as one line: the cause a user fixes, never a listing or a traceback."""
    cause = err.__cause__
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    if isinstance(err, OverrideParseException):
        reason = err.message.strip().splitlines()[0]
        return (
            f"cannot parse the override {err.override!r} ({reason}); quote values with "
            "spaces or brackets, see `python -m amp_lab --help`"
        )
    if found := _NOT_IN_DEFAULTS.search(str(err)):  # a group the defaults list leaves out
        group = found.group(1)
        return (
            f"{group} is an optional group: choose it with +{group}=OPTION "
            f"(options: {_options(group)})"
        )
    for error in (err, cause):  # a bad value, raised as it is or wrapped by Hydra
        if isinstance(error, ValidationError) and error.full_key:
            return _bad_value(error)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        key = str(cause.full_key)
        parent = key.rpartition(".")[0]
        if schema_keys().get(parent, "").startswith("dict"):  # model.kwargs, optim.kwargs
            return f"{parent} is free-form: add a key to it with +{key}=VALUE"
        return (
            f"unknown setting {key}{did_you_mean(key)} (python -m amp_lab --help lists the groups)"
        )
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if cause is not None and str(cause).strip():
        first += f" ({str(cause).strip().splitlines()[0]})"
    return first


def first_sentence(err: BaseException, limit: int = 160) -> str:
    """An underlying library's message cut to its first sentence: torch's checkpoint errors
    explain themselves for a paragraph, repeated once per file."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.split(r"(?<=[a-z0-9)])\. ", text, maxsplit=1)[0].rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."
