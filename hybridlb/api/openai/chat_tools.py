"""What a chat request's ``tools`` and ``tool_choice`` ask for, as vLLM serves them:

* ``none`` (or no tools): the tools reach the chat template, the output is text;
* ``auto``: the model decides; the server's ``--tool-call-parser`` reads calls out of its
  text (a 400 unless the server runs with ``--enable-auto-tool-choice``, as in vLLM);
* ``required`` / a named function: a grammar forces a valid call (``tools.forced``).

Every tool's ``parameters`` must be a schema the grammar library compiles (400 otherwise),
whichever the choice: a definition that could never be forced is wrong in any case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hybridlb.api.errors import APIError
from hybridlb.api.openai import structured
from hybridlb.api.openai.chat_schemas import ChatCompletionRequest, NamedToolChoice
from hybridlb.api.openai.tools import ToolParser, make_parser
from hybridlb.api.openai.tools.forced import (
    NamedParser,
    RequiredParser,
    arguments_schema,
    named_schema,
    required_schema,
)
from hybridlb.config import ApiConfig, StructuredOutputsConfig
from hybridlb.params import Constraint


@dataclass
class ChatTools:
    parser: ToolParser | None = None  # reads calls out of the output
    parser_args: tuple = ()
    constraint: Constraint | None = None  # forces a call


def chat_tools(body: ChatCompletionRequest, api: ApiConfig, options: StructuredOutputsConfig) -> ChatTools:
    choice = body.effective_tool_choice
    if not body.tools:
        return ChatTools()
    for index, tool in enumerate(body.tools):
        field = f"tools[{index}].function.parameters"
        structured.validate(Constraint("json", json.dumps(arguments_schema(tool))), options, field)
    if choice == "none":
        return ChatTools()
    if choice == "auto":
        if not api.enable_auto_tool_choice:
            raise APIError(400, '"auto" tool choice needs the server to run with --enable-auto-tool-choice and '
                                "--tool-call-parser NAME; or send tool_choice \"required\", a named function, or "
                                '"none"', param="tool_choice")
        return ChatTools(make_parser(api.tool_call_parser))
    asked = structured.requested(body, options.backend)
    if asked is not None:
        raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} forces the "
                            f"output to be a call; drop {asked[0]}", param=asked[0])
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in body.tools if t.function.name == choice.function.name)
        schema, parser, args = named_schema(tool), NamedParser(tool.function.name), (tool.function.name,)
    else:
        schema, parser, args = required_schema(body.tools, body.parallel_tool_calls), RequiredParser(), ()
    constraint = Constraint("json", json.dumps(schema))
    structured.validate(constraint, options, "tools")
    return ChatTools(parser, args, constraint)
