"""SSE events: one JSON object per event, whatever text the chunk carries."""

from __future__ import annotations

import json

from ddtree.server.responses import sse


def test_an_event_is_the_payload_as_json_with_text_as_utf8() -> None:
    payload = {"choices": [{"text": "héllo 🌳", "logprobs": None, "index": 0}], "usage": None, "n": 1.5}
    event = sse(payload)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event.removeprefix("data: ")) == payload
    assert "🌳" in event  # not escaped


def test_a_string_utf8_cannot_hold_is_escaped_not_an_error() -> None:
    payload = {"model": "name\udc80", "choices": []}  # a lone surrogate, as argv's undecodable bytes give
    event = sse(payload)
    assert "\\udc80" in event
    assert json.loads(event.removeprefix("data: ")) == payload
