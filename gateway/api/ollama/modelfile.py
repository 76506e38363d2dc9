"""Ollama's /api/create body, and the Modelfile subset it may carry, read into one `CreateSpec`.

Supported: FROM (a served model, or a folder or .gguf file under the operator's allowed
folders), PARAMETER (the sampling defaults and num_ctx mlxgw has), SYSTEM, MESSAGE, TEMPLATE (a
Jinja chat template: Ollama's Go templates are refused), LICENSE (ignored). ADAPTER, blobs
(`files`), `quantize` and a server-side Modelfile `path` are refused with the reason. Every
text is bounded here; a template is only parsed here (no rendering): the worker renders it in
its budgeted sandbox, which bounds loops and output."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ....shared.config_checks import MAX_CONTEXT_LENGTH
from ....shared.errors import invalid

MAX_MODELFILE_BYTES = 64 * 1024
MAX_TEXT_BYTES = 32 * 1024  # SYSTEM, TEMPLATE, one MESSAGE
MAX_MESSAGES = 64
# Ollama parameter -> (models.yaml path, type)
PARAMETERS: dict[str, tuple[tuple[str, ...], type]] = {
    "temperature": (("defaults", "temperature"), float),
    "top_p": (("defaults", "top_p"), float),
    "top_k": (("defaults", "top_k"), int),
    "min_p": (("defaults", "min_p"), float),
    "repeat_penalty": (("defaults", "repetition_penalty"), float),
    "num_predict": (("defaults", "max_tokens"), int),
    "num_ctx": (("context_length",), int),
}
# Ollama's Go templates read fields of a dot: {{ .System }}, {{ range .Messages }}, {{ if .Tools }}
_GO_TEMPLATE = re.compile(r"\{\{-?\s*(?:(?:if|range|with|else if)\s+)?\.[A-Za-z]")
_INSTRUCTION = re.compile(r"^([A-Za-z]+)\s*(.*)$", re.S)


@dataclass
class CreateSpec:
    name: str
    base: str | None = None  # FROM: a model name or a path
    settings: dict = field(default_factory=dict)  # models.yaml fields (nested for defaults)
    system: str | None = None
    template: str | None = None
    messages: list[dict] = field(default_factory=list)


def _bounded(text: str, what: str) -> str:
    if len(text.encode()) > MAX_TEXT_BYTES:
        raise invalid(f"{what} is over {MAX_TEXT_BYTES // 1024} KB", what.lower())
    return text


def check_template(template: str) -> str:
    """A Jinja chat template that parses; Go templates and syntax errors refused."""
    _bounded(template, "TEMPLATE")
    if _GO_TEMPLATE.search(template):
        raise invalid(
            "TEMPLATE is in Ollama's Go template syntax ({{ .Prompt }}); mlxgw renders Jinja chat "
            "templates (the model's tokenizer_config.json format)",
            "template",
        )
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(template)  # parsing only: nothing is evaluated
    except TemplateSyntaxError as e:
        raise invalid(f"TEMPLATE is not a valid Jinja template: {e.message} (line {e.lineno})", "template") from None
    except RecursionError:
        raise invalid("TEMPLATE nests too deeply", "template") from None
    return template


def _parameter(settings: dict, name: str, value) -> None:
    if name not in PARAMETERS:
        raise invalid(f"PARAMETER {name} is not supported by mlxgw (supported: {', '.join(PARAMETERS)})", "parameters")
    path, kind = PARAMETERS[name]
    try:
        number = kind(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number != number or number in (float("inf"), float("-inf")):
        raise invalid(f"PARAMETER {name} must be a {kind.__name__}, got {value!r}", "parameters")
    if name == "num_ctx" and not 16 <= number <= MAX_CONTEXT_LENGTH:
        raise invalid(f"PARAMETER num_ctx must be between 16 and {MAX_CONTEXT_LENGTH}, got {number}", "parameters")
    target = settings
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = number


def _message(role, content) -> dict:
    if role not in ("user", "assistant", "system") or not isinstance(content, str):
        raise invalid("MESSAGE takes a role (user, assistant or system) and a text", "messages")
    return {"role": role, "content": _bounded(content, "MESSAGE")}


def _unquote(text: str) -> str:
    text = text.strip()
    for quote in ('"""', '"'):
        if len(text) >= 2 * len(quote) and text.startswith(quote) and text.endswith(quote):
            return text[len(quote) : -len(quote)]
    return text


def _instructions(modelfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs; triple-quoted arguments may span lines."""
    out, lines, i = [], modelfile.splitlines(), 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            raise invalid(f"Modelfile line {i}: expected an instruction such as FROM or SYSTEM", "modelfile")
        word, arg = match.group(1).upper(), match.group(2)
        if '"""' in arg and arg.count('"""') % 2 == 1:  # a triple-quoted text that goes on
            while i < len(lines) and '"""' not in lines[i]:
                arg += "\n" + lines[i]
                i += 1
            if i >= len(lines):
                raise invalid(f'Modelfile: {word}\'s """ text is never closed', "modelfile")
            arg += "\n" + lines[i]
            i += 1
        out.append((word, arg))
    return out


def _from_modelfile(modelfile: str, body: dict) -> None:
    """Fold a Modelfile's instructions into the structured body (explicit fields win)."""
    if len(modelfile.encode()) > MAX_MODELFILE_BYTES:
        raise invalid(f"modelfile is over {MAX_MODELFILE_BYTES // 1024} KB", "modelfile")
    parameters: dict = {}
    messages: list = []
    for word, arg in _instructions(modelfile):
        if word == "FROM":
            body.setdefault("from", _unquote(arg))
        elif word == "PARAMETER":
            name, _, value = arg.strip().partition(" ")
            parameters[name.strip()] = _unquote(value)
        elif word in ("SYSTEM", "TEMPLATE", "LICENSE"):
            body.setdefault(word.lower(), _unquote(arg))
        elif word == "MESSAGE":
            role, _, content = arg.strip().partition(" ")
            messages.append({"role": role.strip(), "content": _unquote(content)})
        elif word == "ADAPTER":
            body.setdefault("adapters", {"modelfile": arg})
        else:
            raise invalid(f"Modelfile instruction {word} is not supported by mlxgw", "modelfile")
    body.setdefault("parameters", parameters)
    if messages:
        body.setdefault("messages", messages)


def parse_create(body: dict, name: str) -> CreateSpec:
    """The spec of a create request (structured fields, or a `modelfile` text)."""
    if isinstance(body.get("modelfile"), str):
        body = dict(body)
        _from_modelfile(body["modelfile"], body)
    if body.get("path"):
        raise invalid("'path' (a Modelfile on the server) is not read; send the Modelfile's text", "path")
    for refused, why in (
        ("adapters", "ADAPTER (LoRA adapters) is not supported by mlxgw yet"),
        ("files", "blobs ('files') are not supported: name a served model or an allowed path in 'from'"),
        ("quantize", "'quantize' is not supported here: use `mlxgw models import --quantize`"),
    ):
        if body.get(refused):
            raise invalid(why, refused)
    spec = CreateSpec(name=name)
    base = body.get("from")
    if not isinstance(base, str) or not base.strip():
        raise invalid("'from' (or a Modelfile FROM line) is required: a served model or an allowed path", "from")
    spec.base = base.strip()
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise invalid("'parameters' must be an object", "parameters")
    for key, value in parameters.items():
        _parameter(spec.settings, key, value)
    if body.get("system") is not None:
        if not isinstance(body["system"], str):
            raise invalid("'system' must be a string", "system")
        spec.system = _bounded(body["system"], "SYSTEM")
    if body.get("template") is not None:
        if not isinstance(body["template"], str):
            raise invalid("'template' must be a string", "template")
        spec.template = check_template(body["template"])
    messages = body.get("messages") or []
    if not isinstance(messages, list) or len(messages) > MAX_MESSAGES:
        raise invalid(f"'messages' must be a list of at most {MAX_MESSAGES} turns", "messages")
    spec.messages = [
        _message(m.get("role"), m.get("content")) if isinstance(m, dict) else _message(None, None) for m in messages
    ]
    return spec


def _quoted(text: str) -> str:
    return f'"""{text}"""' if "\n" in text or '"' in text else f'"{text}"'


def parameter_lines(entry) -> list[str]:
    """The entry's settings as Ollama parameter lines, `name value` (what `ollama show
    --parameters` prints and Continue parses)."""
    lines = []
    for name, (path, _) in PARAMETERS.items():
        value = entry
        for part in path:
            value = getattr(value, part, None)
        if value is not None:
            lines.append(f"{name} {value}")
    return lines


def render_modelfile(entry, base: str) -> str:
    """The Modelfile an entry would be created from, as `ollama show --modelfile` prints it:
    FROM (what it was made from, else `base`), then TEMPLATE, SYSTEM, PARAMETER, MESSAGE."""
    lines = ['# Modelfile generated by "ollama show"', f"FROM {entry.parent or base}"]
    chat = entry.chat
    if chat.chat_template:
        lines.append(f"TEMPLATE {_quoted(chat.chat_template)}")
    if chat.system is not None:
        lines.append(f"SYSTEM {_quoted(chat.system)}")
    lines += [f"PARAMETER {line}" for line in parameter_lines(entry)]
    lines += [f"MESSAGE {m.role} {_quoted(m.content)}" for m in chat.messages]
    return "\n".join(lines) + "\n"
