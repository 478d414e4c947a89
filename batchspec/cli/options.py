"""Command-line options derived from frozen dataclasses, declared once.

`dataclass_options(EngineConfig)` turns each field into one Typer option: the flag is the field's
name (`batch_size` -> `--batch-size`), the default is the field's default, the help, panel and
metavar come from the field's `metadata` (or, without a "help" there, from the class docstring's
entry for the field, in the layout `name  text` with continuation lines indented; "cli": False
leaves the field out). A bool field
becomes a flag (`--name`, or `--name/--no-name` where its default is True); "none_as" names the
value that stands for None (`--draft-window 0`: the whole context).

`grid_option` is the comma-separated form of a field, for the bench's and verify's grids; `derive`
adds options to a command and hands their values to it as one dict, keyed by field name:

    @derive(dataclass_options(EngineConfig), into="engine")
    def generate(prompt: ..., engine: dict): config = EngineConfig(**engine)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

ENGINE_PANEL = "Engine"


@dataclass(frozen=True)
class CliOption:
    """One derived option: the command's parameter, and how its value becomes the field's."""

    field: str  # the dataclass field it fills
    flags: tuple[str, ...]  # ("--batch-size",), ("--adaptive/--no-adaptive",)
    panel: str  # the --help panel it is listed in
    parameter: inspect.Parameter  # named after the field, annotated with its typer.Option
    to_value: Callable[[Any], Any]  # command-line value -> field value

    @property
    def default(self) -> Any:
        return self.parameter.default


def field_docs(cls) -> dict[str, str]:
    """Each field's entry in the class docstring, whitespace collapsed.

    >>> @dataclass
    ... class C:
    ...     '''Doc.
    ...
    ...     size    rows in one pass,
    ...             at most 8.
    ...     name  who.
    ...     '''
    ...     size: int = 1
    ...     name: str = ""
    >>> field_docs(C)
    {'size': 'rows in one pass, at most 8.', 'name': 'who.'}
    """
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, list[str]] = {}
    current = None
    for line in inspect.getdoc(cls).splitlines() if cls.__doc__ else ():
        m = re.match(r"(\w+)\s{2,}(\S.*)", line)
        if m and m.group(1) in names:
            current = m.group(1)
            docs[current] = [m.group(2)]
        elif current is not None and line.startswith(" ") and line.strip():
            docs[current].append(line.strip())
        else:
            current = None
    return {k: " ".join(v) for k, v in docs.items()}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(hint) -> type:
    """int | None -> int."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and type(None) in typing.get_args(hint) else hint


def _fields(cls) -> dict[str, tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, _base_type(hints[f.name])) for f in dataclasses.fields(cls)}


def _option(name: str, kind: type, default: Any, flags: tuple[str, ...], *, help: str, panel: str,
            metavar: str | None, to_value: Callable[[Any], Any], envvar: str | None = None) -> CliOption:
    info = typer.Option(*flags, help=escape(help), rich_help_panel=panel, metavar=metavar, envvar=envvar,
                        show_default=default is not None and default is not False)
    annotation = Annotated[kind if default is not None else kind | None, info]
    parameter = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
    return CliOption(name, flags, panel, parameter, to_value)


def dataclass_options(cls, *, include: Iterable[str] | None = None, exclude: Iterable[str] = (),
                      panel: str = ENGINE_PANEL, overrides: dict[str, dict] | None = None) -> list[CliOption]:
    """One option per field of `cls` (those in `include`, in the class's order, less `exclude`).
    `overrides` replaces metadata per field, e.g. {"batch_size": {"help": ..., "flags": ("--batch-size", "-b")}}."""
    docs = field_docs(cls)
    fields = _fields(cls)
    wanted = set(include) if include is not None else set(fields)
    unknown = (wanted | set(exclude) | set(overrides or {})) - set(fields)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    options = []
    for name, (f, kind) in fields.items():
        if name not in wanted or name in exclude or f.metadata.get("cli", True) is False:
            continue
        meta = {**f.metadata, **(overrides or {}).get(name, {})}
        default = meta.get("default", f.default)
        flags = meta.get("flags") or (flag_name(name),)
        if kind is bool and default is True:
            flags = tuple(f"{x}/--no-{x[2:]}" for x in flags[:1]) + tuple(flags[1:])
        none_as = meta.get("none_as")
        if none_as is not None and default is None:
            default = none_as
        options.append(_option(
            name, kind, default, flags, help=meta.get("help") or docs.get(name, ""),
            panel=meta.get("panel", panel), metavar="" if kind is bool else meta.get("metavar"),
            envvar=meta.get("envvar"),
            to_value=(lambda v, none_as=none_as: None if none_as is not None and v == none_as else v)))
    return options


def grid_default(value: Any) -> str:
    """How a field's default reads as a one-item list: True -> "on", None -> "none"."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def grid_option(cls, name: str, *, flag: str | None = None, default: str | None = None, help: str | None = None,
                panel: str | None = None) -> CliOption:
    """The comma-separated form of field `name`: a string option (parsed by the command) whose
    default is the field's default as a one-item list unless given."""
    f, _ = _fields(cls)[name]
    meta = f.metadata
    text = help or "Comma-separated: " + (meta.get("help") or field_docs(cls).get(name, ""))
    value = default if default is not None else grid_default(meta.get("none_as", f.default)
                                                              if f.default is None else f.default)
    return _option(name, str, value, (flag or flag_name(name),), help=text, metavar="LIST",
                   panel=panel or meta.get("panel", ENGINE_PANEL), to_value=lambda v: v)


def derive(options: Iterable[CliOption], *, into: str):
    """Add `options` to a Typer command and pass their values to its parameter `into` as
    {field: value}. Those in the first option's panel take `into`'s place among the command's
    parameters, the others (Expert...) come last: --help lists panels in the order they first appear."""
    options = list(options)

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        names = list(signature.parameters)
        if into not in names:
            raise TypeError(f"{command.__name__} has no parameter {into!r} to take the derived options")
        clash = {o.field for o in options} & set(names)
        if clash:
            raise TypeError(f"{command.__name__} already has parameters {', '.join(sorted(clash))}")
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()]
        at = names.index(into)
        main = [o.parameter for o in options if o.panel == options[0].panel]
        last = [o.parameter for o in options if o.panel != options[0].panel]

        @functools.wraps(command)
        def wrapper(**kwargs):
            values = {o.field: o.to_value(kwargs.pop(o.field)) for o in options}
            return command(**kwargs, **{into: values})

        wrapper.__signature__ = signature.replace(parameters=own[:at] + main + own[at + 1:] + last)
        return wrapper

    return decorate


# ------------------------------------------------------- options of no dataclass, shared by commands
SAMPLING_PANEL = "Sampling"

Target = Annotated[str | None, typer.Option(
    "--target", metavar="MODEL", help="Target model: a named model (batchspec models), a local folder, a "
                                      ".gguf file or a hub id; random:<folder or id> for random weights from "
                                      "its config (default: the bundled target)")]
Draft = Annotated[str | None, typer.Option(
    "--draft", metavar="MODEL", help="Draft model sharing the target's tokenizer (default: the bundled draft "
                                     "when --target is not given, else none)")]
Dtype = Annotated[str, typer.Option(
    "--dtype", metavar="NAME", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16 or "
                                    "float64")]
Device = Annotated[str, typer.Option("--device", metavar="NAME",
                                     help="auto (cuda if available), cpu, cuda or cuda:N")]
Prompts = Annotated[str | None, typer.Option(
    "--prompts", metavar="SET", help="Prompts: bundled (the default), chat, grounded, or a JSONL file of "
                                     "{\"prompt\": ...} or Spec-Bench rows")]
Chat = Annotated[bool, typer.Option("--chat", metavar="", help="Wrap prompts in the tokenizer's chat template")]
Temperature = Annotated[float, typer.Option("--temperature", metavar="T", help="0 = greedy",
                                            rich_help_panel=SAMPLING_PANEL)]
TopK = Annotated[int, typer.Option("--top-k", metavar="K", help="0 = off", rich_help_panel=SAMPLING_PANEL)]
TopP = Annotated[float, typer.Option("--top-p", metavar="P", help="1.0 = off", rich_help_panel=SAMPLING_PANEL)]
Seed = Annotated[int | None, typer.Option("--seed", metavar="N", rich_help_panel=SAMPLING_PANEL,
                                             help="Run seed: request i gets a seed derived from it and i")]
JsonPath = Annotated[Path | None, typer.Option("--json", metavar="PATH", help="Write the report as JSON")]
