"""A customer's own Hugging Face model through DigitalOcean's official clients: pydo manages the
dedicated inference, the OpenAI client calls it by the customer's name for the model.

Run by tests/byom_clients.rs in two phases, with these environment variables:

  DI_API_URL      central's base URL (plain HTTP on loopback)
  DI_API_TOKEN    an API token of the team
  HF_TOKEN        the customer's Hugging Face token: it owns the private repositories below
  DI_REGION       the region to create in
  DI_VPC          the team's VPC in that region
  DI_NAME         the dedicated inference's name
  MODEL_NAME      the name clients call the model by (`model_slug`)
  REPO            the repository served first (`provider_model_id`)
  NEXT_REPO       the repository switched to, under the same name
  GPU             the accelerator slug
  WORK_DIR        where the CA file is written
  PHASE           "serve" or "delete"
  DI_ID           phase "delete" only: the id phase "serve" printed

Phase "serve" creates the dedicated inference with pydo, waits for it as automation does
(`status == "active"` and no pending spec), checks the fields came back as sent, fetches the CA
with pydo, lists and chats with the OpenAI client, then switches to NEXT_REPO with pydo's patch
while a background thread calls the endpoint back to back: not one call may fail. Between the
phases the Rust test looks at what the model servers load. Phase "delete" deletes with pydo and
polls until the API answers 404.

Each phase ends with one line `RESULT {json}`. Any failed check raises, which exits non-zero with
a traceback. Token values are never printed.
"""

import base64
import json
import os
import ssl
import threading
import time

import httpx
import openai
from azure.core.pipeline.policies import HeadersPolicy
from pydo import Client

ENV = os.environ
NAME = ENV["MODEL_NAME"]
WAIT_SECONDS = 90


def check(condition, what, got=None):
    if not condition:
        detail = "" if got is None else ": " + json.dumps(got, default=str)[:3000]
        raise AssertionError(f"check failed: {what}{detail}")


def pydo_client():
    """A pydo client for the plain-HTTP test server.

    pydo's default bearer policy refuses to send a token over http://, so the token goes in as a
    plain header instead, which is what every request would carry over https:// anyway. No
    retries: a failed request must show, not be hidden by a second try.
    """
    token = ENV["DI_API_TOKEN"]
    return Client(
        token,
        endpoint=ENV["DI_API_URL"],
        authentication_policy=HeadersPolicy(base_headers={"Authorization": f"Bearer {token}"}),
        retry_total=0,
    ).dedicated_inferences


def with_status(pipeline_response, deserialized, headers):
    """A pydo `cls` callback: (HTTP status, body, headers)."""
    return pipeline_response.http_response.status_code, deserialized, headers


def openai_client(endpoint, token, ca_file):
    """The OpenAI client as the docs tell customers to set it up: the endpoint + /v1, a DI access
    token as the API key, and the DI's CA as the only trust anchor. No retries."""
    context = ssl.create_default_context(cafile=ca_file)
    return openai.OpenAI(
        base_url=f"{endpoint}/v1",
        api_key=token,
        http_client=httpx.Client(verify=context, timeout=10.0),
        max_retries=0,
    )


def wait_active(di, di_id, version):
    """Polls with pydo until active on `version` with nothing pending; the DI and the statuses
    seen. `error` fails at once."""
    deadline = time.monotonic() + WAIT_SECONDS
    seen = []
    while True:
        item = di.get(di_id)["dedicated_inference"]
        status = item["status"]
        if not seen or seen[-1] != status:
            seen.append(status)
        check(status != "error", f"{di_id} went to error", item)
        if (
            status == "active"
            and item["pending_deployment_spec"] is None
            and item["spec"]["version"] == version
        ):
            return item, seen
        check(time.monotonic() < deadline, f"active on version {version} within {WAIT_SECONDS}s", item)
        time.sleep(0.05)


def deployment_as_sent(d):
    return {k: d[k] for k in ("model_slug", "model_provider", "provider_model_id")}


def full_spec(item):
    """The full spec pydo's patch carries, from what GET shows: the latest version, the same
    deployment (`model_id`), only the fields the request takes."""
    spec = item["spec"]
    return {
        "version": spec["version"],
        "name": spec["name"],
        "region": spec["region"],
        "vpc": {"uuid": spec["vpc"]["uuid"]},
        "enable_public_endpoint": spec["enable_public_endpoint"],
        "model_deployments": [
            {
                "model_id": d["model_id"],
                "model_slug": d["model_slug"],
                "model_provider": d["model_provider"],
                "provider_model_id": d["provider_model_id"],
                "workload_config": d["workload_config"],
                "accelerators": [
                    {k: a[k] for k in ("scale", "type", "accelerator_slug")}
                    for a in d["accelerators"]
                ],
            }
            for d in spec["model_deployments"]
        ],
    }


def chat_once(client):
    reply = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Answer the support ticket."}],
        max_tokens=8,
    )
    text = reply.choices[0].message.content or ""
    return reply, text


class Caller(threading.Thread):
    """Calls the endpoint by the customer's name back to back until stopped. Every call that
    raises, or answers for another model or with nothing, is a failure."""

    def __init__(self, endpoint, token, ca_file):
        super().__init__(daemon=True)
        self.client = openai_client(endpoint, token, ca_file)
        self.stopping = threading.Event()
        self.calls = []  # (started, finished, ok), monotonic seconds
        self.failures = []

    def run(self):
        while not self.stopping.is_set():
            started = time.monotonic()
            ok = False
            try:
                reply, text = chat_once(self.client)
                if reply.model == NAME and text.strip():
                    ok = True
                else:
                    self.failures.append(f"answered by {reply.model!r} with {text!r}")
            except Exception as e:  # every exception is a failed call
                self.failures.append(f"{type(e).__name__}: {e}")
            self.calls.append((started, time.monotonic(), ok))
            self.stopping.wait(0.02)

    def ok_calls(self):
        return sum(1 for _, _, ok in self.calls if ok)

    def stop(self):
        self.stopping.set()
        self.join(timeout=30)
        check(not self.is_alive(), "the caller thread stops")


def serve(di):
    region, vpc, repo, next_repo = ENV["DI_REGION"], ENV["DI_VPC"], ENV["REPO"], ENV["NEXT_REPO"]
    sent = {"model_slug": NAME, "model_provider": "hugging_face", "provider_model_id": repo}
    body = {
        "spec": {
            "version": 1,
            "name": ENV["DI_NAME"],
            "region": region,
            "vpc": {"uuid": vpc},
            "enable_public_endpoint": True,
            "model_deployments": [
                dict(
                    sent,
                    workload_config={},
                    accelerators=[
                        {"scale": 1, "type": "prefill_decode", "accelerator_slug": ENV["GPU"]}
                    ],
                )
            ],
        },
        "access_tokens": {"hugging_face_token": ENV["HF_TOKEN"]},
    }
    status, created, _ = di.create(body, cls=with_status)
    check(status == 202, "create answers 202", status)
    item = created["dedicated_inference"]
    di_id = item["id"]
    check(
        deployment_as_sent(item["spec"]["model_deployments"][0]) == sent,
        "the create response shows the deployment as sent",
        item,
    )
    token = created["token"]["value"]
    check(token.startswith("di_"), "the create response carries the endpoint token")
    check(ENV["HF_TOKEN"] not in json.dumps(created), "the Hugging Face token is never shown")
    print(f"created {di_id}", flush=True)

    active, seen_first = wait_active(di, di_id, 1)
    deployment = active["spec"]["model_deployments"][0]
    check(deployment_as_sent(deployment) == sent, "GET shows the deployment as sent", active)
    check(active["spec"]["vpc"]["uuid"] == vpc, "in the team's VPC", active)
    endpoint = active["endpoints"]["public_endpoint_fqdn"]
    check(endpoint.startswith("https://"), "a public HTTPS endpoint", active)

    # The CA through pydo, as the only trust anchor of the OpenAI client.
    pem = base64.b64decode(di.get_ca(di_id)["cert"], validate=True).decode("ascii")
    check(pem.startswith("-----BEGIN CERTIFICATE-----"), "the CA is PEM", pem[:80])
    ca_file = os.path.join(ENV["WORK_DIR"], f"{di_id}-ca.pem")
    with open(ca_file, "w") as f:
        f.write(pem)

    client = openai_client(endpoint, token, ca_file)
    listed = [m.id for m in client.models.list()]
    check(listed == [NAME], "/v1/models lists the customer's name for the model", listed)
    reply, text = chat_once(client)
    check(reply.model == NAME, "the reply names the customer's model", reply.model)
    check(len(text.split()) > 0, "a non-empty completion", text)
    check(reply.usage is not None and reply.usage.completion_tokens > 0, "usage", str(reply.usage))
    pieces = []
    for chunk in client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Stream it."}], max_tokens=8, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    check(len("".join(pieces).split()) > 0, "a non-empty stream", pieces)
    # Clients call it by the customer's name: the repository's id is not a name it answers to.
    try:
        client.chat.completions.create(
            model=repo, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        check(False, f"{repo} is not a served name")
    except openai.NotFoundError as e:
        check(e.status_code == 404, "an unknown model name is 404", e.status_code)

    # Another repository under the same name, while the endpoint is called continuously.
    caller = Caller(endpoint, token, ca_file)
    caller.start()
    deadline = time.monotonic() + 10
    while caller.ok_calls() < 5 and not caller.failures:
        check(time.monotonic() < deadline, "the caller gets going", caller.calls[-5:])
        time.sleep(0.02)
    spec = full_spec(active)
    check(spec["version"] == 1, "the latest version is 1", spec)
    spec["model_deployments"][0]["provider_model_id"] = next_repo
    patched_at = time.monotonic()
    status, patched, _ = di.patch(di_id, {"spec": spec}, cls=with_status)
    check(status == 202, "patch answers 202", status)
    item = patched["dedicated_inference"]
    pending = item["pending_deployment_spec"]
    check(pending["version"] == 2, "version 2 is pending", item)
    check(
        deployment_as_sent(pending["model_deployments"][0]) == dict(sent, provider_model_id=next_repo),
        "the pending spec names the new repository under the same name",
        pending,
    )
    check(
        item["spec"]["model_deployments"][0]["provider_model_id"] == repo,
        "version 1 serves meanwhile",
        item,
    )
    switched, seen_switch = wait_active(di, di_id, 2)
    active_at = time.monotonic()
    time.sleep(0.5)
    caller.stop()
    check(not caller.failures, "not one failed call during the switch", caller.failures[:20])
    during = sum(1 for s, f, ok in caller.calls if ok and s >= patched_at and f <= active_at)
    check(caller.ok_calls() >= 10, "the caller was calling", len(caller.calls))
    check(during >= 3, "calls answered while the switch rolled out", during)
    deployment = switched["spec"]["model_deployments"][0]
    check(
        deployment_as_sent(deployment) == dict(sent, provider_model_id=next_repo),
        "GET shows the new repository under the same name",
        switched,
    )
    check(
        deployment["model_id"] == active["spec"]["model_deployments"][0]["model_id"],
        "the same deployment",
        switched,
    )
    check(switched["endpoints"]["public_endpoint_fqdn"] == endpoint, "the same endpoint", switched)
    reply, _ = chat_once(client)
    check(reply.model == NAME, "served under the same name after the switch", reply.model)
    listed_after = [m.id for m in client.models.list()]
    check(listed_after == [NAME], "/v1/models after the switch", listed_after)

    return {
        "id": di_id,
        "statuses": [seen_first, seen_switch],
        "models": listed,
        "calls_ok": caller.ok_calls(),
        "calls_during_switch": during,
        "switch_seconds": round(active_at - patched_at, 3),
        "openai_version": openai.__version__,
    }


def delete(di):
    di_id = ENV["DI_ID"]
    status, body, _ = di.delete(di_id, cls=with_status)
    check(status == 202, "delete answers 202", [status, body])
    # pydo returns get's 404 body rather than raising: poll until it is that.
    deadline = time.monotonic() + WAIT_SECONDS
    seen = []
    while True:
        status, body, _ = di.get(di_id, cls=with_status)
        if status == 404:
            check(body["id"] == "not_found" and body["message"], "404 error shape", body)
            break
        check(status == 200, "GET answers 200 until 404", [status, body])
        state = body["dedicated_inference"]["status"]
        if not seen or seen[-1] != state:
            seen.append(state)
        check(state == "deleting", "a DI being deleted reads as deleting", body)
        check(time.monotonic() < deadline, f"404 within {WAIT_SECONDS}s", body)
        time.sleep(0.05)
    listed = di.list()
    check(
        all(d["id"] != di_id for d in listed["dedicated_inferences"]),
        "a deleted DI is not listed",
        listed,
    )
    return {"id": di_id, "statuses": seen}


def main():
    di = pydo_client()
    phase = ENV["PHASE"]
    if phase == "serve":
        result = serve(di)
    elif phase == "delete":
        result = delete(di)
    else:
        raise SystemExit(f"unknown PHASE {phase!r}")
    result["phase"] = phase
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()  # an exception prints its traceback and exits 1
