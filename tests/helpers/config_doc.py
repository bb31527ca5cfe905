"""docs/configuration.md, written from the schema itself (amp_lab/config.py): per group its
docstring and its options (the YAML files of conf/<group>/), per key its type, default and the
comment beside it. tests/test_config.py fails when the committed page differs from what this
writes, so no key can miss its entry or drift from its default; `UPDATE_DOCS=1 python -m pytest
tests/test_config.py -k reference` rewrites it."""

from __future__ import annotations

import enum
import inspect
import io
import json
import tokenize
import typing
from dataclasses import MISSING, fields, is_dataclass

from amp_lab.config import CONF_DIR, AmpLabConfig
from helpers.compose import ROOT

PAGE = ROOT / "docs" / "configuration.md"
HEAD = """# Configuration reference

Every key of the schema (`amp_lab/config.py`), group by group: its type, its default and what
it does. Set any of them on the command line (`python -m amp_lab scaler.init_scale=32768`); pick
an option of a group with `group=option` (`precision=bf16`), an optional group with `+group=option`
(`+recipe=deit`). A typo or a wrong type is one line and exit code 2. The YAML files under
`amp_lab/conf/` hold only what an option changes.

This page is written from the schema (`tests/helpers/config_doc.py`; a test fails when it
differs from it). Regenerate it with `UPDATE_DOCS=1 python -m pytest tests/test_config.py -k
reference`.
"""


def _comments(cls: type) -> dict[str, str]:
    """Each field's comment: the one on its line, else the comment lines right above it."""
    source = inspect.getsource(cls)
    found: dict[str, str] = {}
    above: list[str] = []
    line_tokens: dict[int, list[tokenize.TokenInfo]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        line_tokens.setdefault(tok.start[0], []).append(tok)
    for number in sorted(line_tokens):
        toks = [t for t in line_tokens[number] if t.type not in (tokenize.NL, tokenize.NEWLINE)]
        kinds = [t.type for t in toks if t.type not in (tokenize.INDENT, tokenize.DEDENT)]
        if kinds == [tokenize.COMMENT]:
            text = toks[-1].string.lstrip("# ").rstrip()
            if not text.startswith("--"):  # `# -- one run: ...` heads a part of the group
                above.append(text)
            continue
        names = [t for t in toks if t.type == tokenize.NAME]
        ops = [t.string for t in toks if t.type == tokenize.OP]
        if names and ":" in ops and names[0].start[1] == 4:  # `    name: type = default`
            trailing = [t.string.lstrip("# ") for t in toks if t.type == tokenize.COMMENT]
            found[names[0].string] = " ".join([*above, *trailing]).strip()
        above = []
    return found


def _type(hint: typing.Any) -> str:
    """The type as a table cell: an Enum's choices, `str \\| None`."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        text = " | ".join(member.value for member in hint)
    elif getattr(hint, "__name__", None) and not typing.get_args(hint):
        text = hint.__name__
    else:
        text = str(hint).replace("typing.", "")
    return text.replace("|", "\\|")  # a pipe would end the cell


def _default(value: typing.Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1024:
        value = int(value)
    return f"`{json.dumps(value)}`"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _rows(prefix: str, cls: type, instance: typing.Any) -> list[str]:
    hints, comments, rows = typing.get_type_hints(cls), _comments(cls), []
    for f in fields(cls):
        value = getattr(instance, f.name)
        if is_dataclass(value):  # a nested group: trainer.ema
            rows += _rows(f"{prefix}.{f.name}", type(value), value)
            continue
        what = comments.get(f.name, "").replace("|", "\\|")  # a pipe would end the cell
        rows.append(
            f"| `{prefix}.{f.name}` | {_type(hints[f.name])} | {_default(value)} | {what} |"
        )
    return rows


def configuration_markdown() -> str:
    """The whole page, as the schema says it today."""
    parts = [HEAD]
    schema = AmpLabConfig()
    top = _comments(AmpLabConfig)
    for group in fields(AmpLabConfig):
        section = getattr(schema, group.name)
        if not is_dataclass(section):
            hint = typing.get_type_hints(AmpLabConfig)[group.name]
            default = group.default_factory() if group.default is MISSING else group.default  # type: ignore[misc]
            parts += [
                f"## `{group.name}`",
                "",
                f"{_type(hint)}, default {_default(default)}: {top.get(group.name, '')}",
                "",
            ]
            continue
        options = _options(group.name)
        parts += [
            f"## `{group.name}`",
            "",
            inspect.cleandoc(type(section).__doc__ or ""),
            "",
            f"Options: {', '.join(f'`{o}`' for o in options)}." if options else "Keys only.",
            "",
            "| key | type | default | what it does |",
            "|---|---|---|---|",
            *_rows(group.name, type(section), section),
            "",
        ]
    return "\n".join(parts).rstrip() + "\n"
