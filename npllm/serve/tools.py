"""Tool calls on /v1/chat/completions: `tools`, `tool_choice` and `parallel_tool_calls` checked, the constraint that
makes the reply a call (or free text where `auto` lets it be), and the reply's calls as OpenAI's `tool_calls`.

The call format is Hermes / Qwen's, which their chat templates teach the model: each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, calls one after another. The grammar (npllm.constraint,
Lark with llguidance's %json) makes every call's name one of the tools' and its arguments valid against that tool's
`parameters`; `auto` lets the reply be free text instead, decided by its first character (a call starts with `<`).

    parse_tools(body) -> Tools | None           the request's fields checked (ApiError naming the field)
    Tools.constraint() -> Constraint | None     the grammar of the reply (None for tool_choice "none")
    tool_calls(text) -> [call, ...] | None      a reply's calls as OpenAI's tool_calls (arguments a JSON string)
    call_chunks(calls) -> [delta, ...]          the streamed deltas: per call one with its id and name, then
                                                argument fragments that concatenate to the whole
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..constraint import JSON_DEFAULTS, Constraint, check_schema
from ..errors import ConstraintError

CHOICES = ("none", "auto", "required")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
FRAGMENT = 16  # characters of arguments per streamed delta


class ToolError(ValueError):
    """A bad tools / tool_choice field: the message and the field's name (protocol turns it into a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    functions: tuple  # ({"name", "description", "parameters"}, ...) as the request gave them
    choice: str  # "none", "auto", "required", or the name of the one function to call
    parallel: bool

    def for_template(self) -> list[dict]:
        """The tools as Hugging Face chat templates take them (tools=)."""
        return [{"type": "function", "function": dict(f)} for f in self.functions]

    def constraint(self) -> Constraint | None:
        """The reply's grammar: calls (one, or several with parallel_tool_calls), or under "auto" free text too."""
        if self.choice == "none":
            return None
        names = [f["name"] for f in self.functions] if self.choice in CHOICES else [self.choice]
        by_name = {f["name"]: f for f in self.functions}
        alternatives = [{"type": "object", "properties": {"name": {"const": n},
                                                          "arguments": by_name[n].get("parameters", {})},
                         "required": ["name", "arguments"], "additionalProperties": False} for n in names]
        schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
        schema = {**schema, "x-guidance": JSON_DEFAULTS}  # compact JSON, as Constraint.json makes it
        calls = 'call ("\\n" call)*' if self.parallel else "call"
        lines = [f"start: {'TEXT | ' if self.choice == 'auto' else ''}calls", f"calls: {calls}",
                 f'call: "<tool_call>" %json {json.dumps(schema)} "</tool_call>"']
        if self.choice == "auto":
            lines.append(r"TEXT: /[^<](?s:.)*/")  # free text: anything that does not open a call
        return Constraint.grammar("\n".join(lines))


def parse_tools(body: dict) -> Tools | None:
    """The request's tools, tool_choice and parallel_tool_calls, checked; None without tools."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of {type: function, function: {...}}", "tools")
    functions = tuple(_function(tool, i) for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise ToolError("tools name the same function twice", "tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return Tools(functions, _choice(choice, names), True if parallel is None else parallel)


def _function(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(f"{where} must be {{type: function, function: {{name, description, parameters}}}}", "tools")
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not NAME.fullmatch(function["name"]):
        raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -", "tools")
    parameters = function.get("parameters", {"type": "object"})
    try:
        check_schema(parameters)
        Constraint.json(parameters)
    except ConstraintError as e:
        raise ToolError(f"{where}.function.parameters: {e}", "tools") from None
    return {"name": function["name"], "description": function.get("description", ""), "parameters": parameters}


def _choice(choice, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolError(f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise ToolError(f"tool_choice must name one of the tools ({', '.join(names)})", "tool_choice")
    return name


def tool_calls(text: str) -> list[dict] | None:
    """The calls in a reply as OpenAI's tool_calls ({id, type, function: {name, arguments}}), None if it has none."""
    calls = []
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
    return calls or None


def call_chunks(calls: list[dict]) -> list[dict]:
    """The deltas OpenAI streams a reply's calls in: per call, one with its index, id and name (arguments ""), then
    its arguments in fragments; each fragment's delta keyed by the call's index."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        arguments = call["function"]["arguments"]
        for start in range(0, len(arguments), FRAGMENT):
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments":
                                                                           arguments[start:start + FRAGMENT]}}]})
    return deltas
