"""Calls a dedicated inference's endpoint with the official OpenAI Python client, as a customer
would: base URL = the endpoint the public API reports + /v1, api_key = a DI access token, and an
httpx client that trusts only the DI's CA (GET .../{id}/ca).

Input (environment): OPENAI_BASE_URL, DI_CA_FILE, DI_MODEL, DI_TOKENS (a JSON list of tokens
that must work), DI_BAD_TOKEN (a token that must be refused). Token values are never printed.
Output: a last line `RESULT {json}` the Rust test asserts on; any failed check exits non-zero.
"""

import json
import os
import ssl
import sys

import httpx
import openai


def client(token: str, ca_file: str) -> openai.OpenAI:
    # The CA file is the only trust anchor: the system's roots are not loaded.
    context = ssl.create_default_context(cafile=ca_file)
    return openai.OpenAI(
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=token,
        http_client=httpx.Client(verify=context, timeout=10.0),
        max_retries=0,
    )


def check(condition: bool, what: str) -> None:
    if not condition:
        print(f"check failed: {what}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    ca_file = os.environ["DI_CA_FILE"]
    model = os.environ["DI_MODEL"]
    tokens = json.loads(os.environ["DI_TOKENS"])
    result = {"openai_version": openai.__version__, "chats": 0, "streams": 0, "models": []}

    for n, token in enumerate(tokens):
        c = client(token, ca_file)
        listed = [m.id for m in c.models.list()]
        check(model in listed, f"token #{n}: /v1/models lists {listed}, not {model}")
        result["models"] = listed

        reply = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello to the system test."}],
            max_tokens=8,
        )
        check(reply.model == model, f"token #{n}: reply names model {reply.model}")
        text = reply.choices[0].message.content or ""
        check(len(text.split()) > 0, f"token #{n}: empty completion")
        check(reply.choices[0].finish_reason in ("stop", "length"), f"token #{n}: finish_reason")
        check(reply.usage is not None and reply.usage.completion_tokens > 0, f"token #{n}: usage")
        result["chats"] += 1

        pieces = []
        stream = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Stream a greeting."}],
            max_tokens=8,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        check(len("".join(pieces).split()) > 0, f"token #{n}: empty stream")
        result["streams"] += 1

    try:
        client(os.environ["DI_BAD_TOKEN"], ca_file).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        check(False, "an unknown token was accepted")
    except openai.AuthenticationError as e:
        result["rejected_status"] = e.status_code

    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
