"""The official `openai` client against a live server: completions, chat, streams, errors, the API key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ddtree.server.app import create_app
from ddtree.server.model import ServedModel
from tests.ddtree.server.conftest import settings_for
from tests.ddtree.server.support import alone, encode, live_server

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
KEY = "sekret"


@pytest.fixture
def client(tiny_dirs: tuple[Path, Path], served: ServedModel) -> Iterator[openai.OpenAI]:
    served.tokenizer.chat_template = TEMPLATE
    try:
        with live_server(create_app(settings_for(tiny_dirs, api_key=KEY), served)) as (url, _, _):
            yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    finally:
        served.tokenizer.chat_template = None


def test_completions_and_chat_whole_and_streamed(client: openai.OpenAI, served: ServedModel) -> None:
    model = client.models.list().data[0].id
    assert model == served.model_id

    ids, text = alone(served, encode(served, "Hello, tree"), 24)
    done = client.completions.create(model=model, prompt="Hello, tree", max_tokens=24, temperature=0)
    assert done.choices[0].text == text and done.usage is not None and done.usage.completion_tokens == len(ids)
    stream = client.completions.create(model=model, prompt="Hello, tree", max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text

    prompt = encode(served, "<system>be brief\n<user>hi\n<assistant>")
    ids, text = alone(served, prompt, 20)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == text
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt)
    assert chat.usage.completion_tokens == len(ids)

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_errors_reach_the_client_as_openais(client: openai.OpenAI, tiny_dirs: tuple[Path, Path]) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=client.models.list().data[0].id, prompt="hi", temperature=3)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").models.list()
