"""The OpenAI Python SDK against `les serve`'s /v1/responses: a plain answer,
a named function call whole and streamed, an incomplete stream, a follow-up
with the call's output, and a refused request. Prints one JSON object.

Usage: openai_responses.py PORT
"""

import json
import sys

from openai import BadRequestError, OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none")
tools = [{
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"]},
}]
named = {"type": "function", "name": "get_weather"}
out = {}

r = client.responses.create(model="m", input="Weather in Paris?", max_output_tokens=8, temperature=0)
out["plain"] = {"status": r.status, "text": r.output_text, "output_tokens": r.usage.output_tokens}

r = client.responses.create(model="m", input="Weather?", tools=tools, tool_choice=named,
                            max_output_tokens=100, temperature=0)
out["call"] = [{"type": o.type, "name": o.name, "arguments": o.arguments, "call_id": o.call_id}
               for o in r.output if o.type == "function_call"]

with client.responses.stream(model="m", input="Weather?", tools=tools, tool_choice=named,
                             max_output_tokens=100, temperature=0) as s:
    types = [e.type for e in s]
    final = s.get_final_response()
out["streamed_call"] = {"events": types, "arguments": [o.arguments for o in final.output
                                                       if o.type == "function_call"]}

with client.responses.stream(model="m", input="Weather in Paris?", max_output_tokens=8,
                             temperature=0) as s:
    events = list(s)
out["incomplete_stream"] = {"last": events[-1].type, "text": events[-1].response.output_text}

r = client.responses.create(model="m", tools=tools, max_output_tokens=5, temperature=0, input=[
    {"role": "user", "content": "Weather?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": "{\"city\": \"Paris\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}])
out["follow_up"] = {"status": r.status, "text": r.output_text}

try:
    client.responses.create(model="m", input="x", previous_response_id="resp_1")
    out["refused"] = None
except BadRequestError as e:
    out["refused"] = e.status_code

print(json.dumps(out))
