"""The structured-output case set: JSON schemas and regexes with a prompt each.

Shared by `ridge bench structured` (which library, and what a mask costs) and
tests/test_structured_smollm2.py (every output parses and validates). Strings
carry a maxLength or a pattern: a 135M model under a constraint can otherwise
run a string to max_tokens, and a cut-off output validates against nothing."""
from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": ("Describe a fictional person as JSON with a name, an age and optionally an email.", {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}},
        "required": ["name", "age"], "additionalProperties": False}),
    "address": ("Give the address of a company as JSON.", {
        "type": "object",
        "properties": {"company": NAME, "address": {
            "type": "object",
            "properties": {"street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False}},
        "required": ["company", "address"], "additionalProperties": False}),
    "tags": ("List one to three tags for an article about gardening, as JSON.", {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 16},
                                "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False}),
    "sentiment": ("Classify the sentiment of 'I loved this film!' as JSON.", {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"], "additionalProperties": False}),
    "weather": ("Report today's weather in Paris as JSON.", {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                       "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
        "required": ["temperature", "humidity", "sky"], "additionalProperties": False}),
    "codes": ("Give a flight as JSON: its date and its flight code.", {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                       "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"}},
        "required": ["date", "code"], "additionalProperties": False}),
    "movie": ("Describe a film as JSON: the title is required, the year and the rating are optional.", {
        "type": "object",
        "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                       "rating": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["title"], "additionalProperties": False}),
    "order": ("Write a shopping order of one to three products as JSON.", {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"product": NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["product", "quantity"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    "task": ("Describe a to-do item as JSON.", {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "note": {"anyOf": [NAME, {"type": "null"}]},
                       "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["done", "note", "priority"], "additionalProperties": False}),
    "digits": ("Give two to five small numbers as a JSON array.", {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5}),
    "tool_call": ("Call a tool to get the weather in Rome, as JSON.", {
        "type": "object",
        "properties": {"name": {"enum": ["get_weather", "get_time"]}, "arguments": {
            "type": "object",
            "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}),
    "deep": ("Write a nested JSON object four levels deep.", {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
            "c": {"type": "object", "properties": {"d": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                  "required": ["d"], "additionalProperties": False}},
            "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False}),
}

REGEXES: dict[str, tuple[str, str]] = {
    "phone": ("Write a US phone number.", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    "date": ("When did the Berlin wall fall? Answer with a date.", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    "ipv4": ("Give an example IP address.", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    "email": ("Write an email address.", r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)"),
    "yes_no": ("Is Paris in France? Answer yes or no.", r"(yes|no)"),
    "colour": ("Give a colour as a hex code.", r"#[0-9a-f]{6}"),
    "sentence": ("Describe the sea in one short sentence.", r"[A-Z][a-z ,]{4,60}\."),
    "numbers": ("List three to five numbers.", r"[0-9]{1,3}(, [0-9]{1,3}){2,4}"),
}

# A typical schema for compile-time figures: the tool call, a vLLM-style workload.
TYPICAL = "tool_call"
