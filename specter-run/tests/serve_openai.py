"""Drives `specter-run serve` with the official OpenAI Python client.

Usage: python3 serve_openai.py BASE_URL MODEL   (BASE_URL like http://127.0.0.1:PORT/v1)

Completions and chat completions, whole and streamed: the streamed text must equal the whole
text for the same greedy request, usage must add up, and an unknown model must raise the
client's NotFoundError. Exits non-zero (with the reason) on any mismatch.
"""

import sys

import openai


def check(condition, message):
    if not condition:
        sys.exit(f"FAILED: {message}")


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)

    listed = [m.id for m in client.models.list().data]
    check(listed == [model], f"models: {listed}")

    greedy = dict(model=model, max_tokens=12, temperature=0, seed=1)

    whole = client.completions.create(prompt="The quick brown fox", **greedy)
    text = whole.choices[0].text
    check(whole.choices[0].finish_reason in ("stop", "length"), f"finish: {whole}")
    usage = whole.usage
    check(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, f"usage: {usage}")
    check(usage.completion_tokens >= 1, f"usage: {usage}")
    pieces = []
    finish = None
    for chunk in client.completions.create(prompt="The quick brown fox", stream=True, **greedy):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    check("".join(pieces) == text, f"streamed {''.join(pieces)!r} != whole {text!r}")
    check(finish == whole.choices[0].finish_reason, f"streamed finish {finish}")

    by_ids = client.completions.create(prompt=[1, 40, 41, 42], **greedy)
    check(by_ids.usage.prompt_tokens == 4, f"token-id prompt: {by_ids.usage}")

    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Say hello."},
    ]
    chat = client.chat.completions.create(messages=messages, **greedy)
    reply = chat.choices[0].message
    check(reply.role == "assistant", f"chat role: {reply}")
    check(chat.usage.completion_tokens >= 1, f"chat usage: {chat.usage}")
    pieces = []
    for chunk in client.chat.completions.create(messages=messages, stream=True, **greedy):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    check("".join(pieces) == (reply.content or ""), f"chat streamed {''.join(pieces)!r} != {reply.content!r}")

    try:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        check(False, "an unknown model was accepted")
    except openai.NotFoundError as e:
        check("no-such-model" in str(e), f"unknown model error: {e}")
    try:
        client.completions.create(model=model, prompt="hi", max_tokens=0)
        check(False, "max_tokens 0 was accepted")
    except openai.BadRequestError:
        pass
    print("ok")


if __name__ == "__main__":
    main()
