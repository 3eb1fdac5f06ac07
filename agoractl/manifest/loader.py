"""Load a run manifest from YAML: ``--set`` overrides, validation, and errors with ``file:line``.

Every problem is collected and reported at once: field errors from pydantic (each with its dotted
path, the YAML line it sits on and, for a misspelt key, the nearest valid key) and the cross-field
rules of :func:`agoractl.manifest.schema.cross_field_errors`. Cross-field rules are checked even
when some fields are wrong, on a copy with the wrong fields removed, so one run of
``agoractl manifest validate`` shows everything that needs fixing.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, get_args, get_origin

from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError
from ruamel.yaml.reader import ReaderError

from agoractl.errors import UsageError
from agoractl.manifest.schema import API_VERSION, KIND, Run, cross_field_errors

_SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_PATH = re.compile(r"[^.\[\]=]+(\.[^.\[\]=]+|\[\d+\])*")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest."""

    path: str
    message: str
    location: str  # "file:line", "--set", or the file alone

    def __str__(self) -> str:
        return f"{self.location}: {self.path}: {self.message}"


class ManifestError(UsageError):
    """A manifest that does not validate; carries every problem found."""

    def __init__(self, source: str, problems: list[Problem]):
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(
            f"{source}: {len(problems)} problem(s) in the manifest:\n{lines}",
            hint="fix the fields above; `agoractl manifest schema` lists every field",
        )


def dotted(loc: Iterable[Any]) -> str:
    """('stages', 0, 'layers') -> 'stages[0].layers'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def split_path(path: str) -> list[Any]:
    """'stages[1].layers' or 'stages.1.layers' -> ['stages', 1, 'layers']."""
    parts: list[Any] = []
    for name, index in _SEGMENT.findall(path):
        if index:
            parts.append(int(index))
        elif name.isdigit():
            parts.append(int(name))
        else:
            parts.append(name)
    if not _PATH.fullmatch(path):
        raise UsageError(f"--set: {path!r} is not a dotted path", hint="write e.g. --set training.max_steps=10")
    return parts


def _yaml() -> YAML:
    y = YAML(typ="rt")
    y.allow_duplicate_keys = False
    return y


def parse_scalar(text: str) -> Any:
    """A --set value, parsed as a YAML scalar (or flow list/map): '0.1' -> 0.1, 'null' -> None."""
    try:
        value = YAML(typ="safe").load(io.StringIO(text))
    except MarkedYAMLError as e:
        raise UsageError(f"--set value {text!r} is not valid YAML: {e.problem}", hint="quote strings with spaces")
    return value


def apply_overrides(data: dict, overrides: Iterable[str]) -> list[str]:
    """Apply `dotted.path=value` overrides in place; returns the dotted paths overridden."""
    touched = []
    for item in overrides:
        if "=" not in item:
            raise UsageError(f"--set {item!r} has no '='", hint="write --set dotted.path=value")
        path, text = item.split("=", 1)
        parts = split_path(path.strip())
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            nxt = parts[i + 1]
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    raise UsageError(f"--set {path}: index [{part}] is out of range")
                node = node[part]
            else:
                if not isinstance(node, dict):
                    raise UsageError(f"--set {path}: {dotted(parts[:i])} is not a mapping")
                if node.get(part) is None:
                    node[part] = [] if isinstance(nxt, int) else {}
                node = node[part]
        last = parts[-1]
        if isinstance(last, int):
            if not isinstance(node, list) or last >= len(node):
                raise UsageError(f"--set {path}: index [{last}] is out of range")
        elif not isinstance(node, dict):
            raise UsageError(f"--set {path}: {dotted(parts[:-1])} is not a mapping")
        node[last] = parse_scalar(text)
        touched.append(dotted(parts))
    return touched


def _line_of(data: Any, loc: tuple) -> Optional[int]:
    """1-based YAML line of the deepest part of `loc` present in `data` (a ruamel round-trip tree)."""
    line, node = None, data
    for part in loc:
        lc = getattr(node, "lc", None)
        try:
            if isinstance(part, int) and isinstance(node, list) and part < len(node):
                line = lc.item(part)[0] + 1 if lc else line
                node = node[part]
            elif isinstance(node, dict) and part in node:
                line = lc.key(part)[0] + 1 if lc else line
                node = node[part]
            else:
                break
        except (KeyError, TypeError, AttributeError):
            break
    if line is None and getattr(data, "lc", None) is not None and loc:
        return None
    return line


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The pydantic model class that holds the field at `loc` (for 'did you mean')."""
    model: Any = Run
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        while get_origin(ann) is not None:
            ann = next((a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)), None) or (
                get_args(ann)[0] if get_args(ann) else None
            )
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _message(err: dict) -> str:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        model = _model_at(loc)
        msg = "unknown key"
        if model is not None:
            close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
            if close:
                msg += f"; did you mean {dotted(loc[:-1] + (close[0],))!r}?"
            else:
                msg += f"; valid keys here: {', '.join(model.model_fields)}"
        return msg
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] not in ("missing",) and "input" in err and not isinstance(err["input"], (dict, list)):
        msg += f" (got {err['input']!r})"
    return msg


def _delete(data: Any, loc: tuple) -> bool:
    node = data
    for part in loc[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    try:
        if isinstance(node, list) and isinstance(loc[-1], int):
            return False
        del node[loc[-1]]
        return True
    except (KeyError, IndexError, TypeError):
        return False


def _field_errors(data: dict) -> list[dict]:
    try:
        Run.model_validate(data, context={"skip_cross_fields": True})
        return []
    except ValidationError as e:
        return [err for err in e.errors() if err["loc"]]


def validate_data(data: dict, source: str, set_paths: Iterable[str] = ()) -> Run:
    """Validate a manifest tree; raise ManifestError listing every problem."""
    set_paths = set(set_paths)

    def where(loc: tuple) -> str:
        path = dotted(loc)
        if any(path == p or path.startswith(p + ".") or path.startswith(p + "[") for p in set_paths):
            return "--set"
        line = _line_of(data, loc)
        return f"{source}:{line}" if line else source

    problems: list[Problem] = []
    repaired = copy.deepcopy(dict(data))
    removed: list[str] = []
    errors = _field_errors(data)
    for err in errors:
        loc = tuple(err["loc"])
        problems.append(Problem(dotted(loc), _message(err), where(loc)))
    # Remove the offending fields so the cross-field rules can still be checked.
    for _ in range(6):
        if not errors:
            break
        for err in errors:
            loc = tuple(err["loc"])
            while loc and not _delete(repaired, loc):
                loc = loc[:-1]
            removed.append(dotted(loc) or "<root>")
        errors = _field_errors(repaired)
    if not errors:
        run = Run.model_validate(repaired, context={"skip_cross_fields": True})
        for path, msg in cross_field_errors(run):
            if any(r and (r in path or r in msg or path.startswith(r)) for r in removed):
                continue
            loc = tuple(split_path(path)) if path else ()
            problems.append(Problem(path, msg, where(loc)))
    if problems:
        raise ManifestError(source, problems)
    return Run.model_validate(data)


def read_yaml(path: Path) -> dict:
    """The manifest's YAML tree; one-line UsageError for a missing, unreadable, binary or empty file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such manifest file", hint="pass a path to a run manifest (YAML)") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a directory, not a manifest file",
                         hint="pass a path to a run manifest (YAML)") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 YAML (byte 0x{e.object[e.start]:02x} at offset {e.start})",
                         hint="pass a run manifest: a YAML text file") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read the manifest: {e.strerror}") from None
    try:
        data = _yaml().load(text)
    except ReaderError as e:  # control characters: a binary file that happens to decode as UTF-8
        raise UsageError(f"{path}: not UTF-8 YAML (character {_char(e.character)} at offset {e.position}: {e.reason})",
                         hint="pass a run manifest: a YAML text file") from None
    except MarkedYAMLError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else "?"
        raise ManifestError(str(path), [Problem("<yaml>", str(e.problem), f"{path}:{line}")])
    except Exception as e:  # ruamel raises several non-Marked errors for duplicate keys etc.
        raise ManifestError(str(path), [Problem("<yaml>", str(e).splitlines()[0], str(path))])
    if data is None or data == {}:
        raise UsageError(f"{path}: the manifest is empty: apiVersion and kind are missing",
                         hint=f"start it with 'apiVersion: {API_VERSION}' and 'kind: {KIND}' "
                              "(see manifests/local-cpu.yaml)")
    if not isinstance(data, dict):
        raise ManifestError(str(path), [Problem("<root>", "a manifest is a YAML mapping", f"{path}:1")])
    return data


def _char(c: Any) -> str:
    return f"#x{ord(c):04x}" if isinstance(c, str) else f"#x{c:02x}" if isinstance(c, int) else repr(c)


def load_manifest(path: str | Path, overrides: Iterable[str] = ()) -> Run:
    """Read, override and validate a manifest file."""
    p = Path(path)
    data = read_yaml(p)
    touched = apply_overrides(data, overrides)
    return validate_data(data, str(p), touched)


def manifest_hash(run: Run) -> str:
    """Short content hash of the validated manifest (recorded in checkpoints)."""
    return hashlib.sha256(run.model_dump_json().encode()).hexdigest()[:16]
