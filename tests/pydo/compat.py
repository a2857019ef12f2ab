"""Drives the central API through pydo, DigitalOcean's official Python client.

Run by tests/pydo_compat.rs, in two phases, with these environment variables:

  PYDO_BASE_URL   central's base URL (plain HTTP on loopback)
  PYDO_TOKEN      an API token with every dedicated inference scope
  PYDO_PHASE      "1" or "2"
  PYDO_DI_ID      phase 2 only: the id phase 1 printed
  PYDO_DI_REGION  phase 2 only: the region phase 1 printed

Phase 1 reads the catalog, creates a dedicated inference and prints its id. Between the phases
the Rust test plays the worker (provisioning, accelerators observed, rollout of version 1), so
phase 2 finds an active DI with accelerators and runs every remaining operation.

Each phase ends with one line `RESULT {json}` naming the pydo operations it called; phase 2 also
prints the summary line `pydo compat: N operations passed: ...`. Any failed check raises, which
exits non-zero with a traceback.
"""

import base64
import json
import os
import sys
import uuid

from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
)
from azure.core.pipeline.policies import HeadersPolicy
from pydo import Client

ALL_OPERATIONS = [
    "list",
    "create",
    "get",
    "patch",
    "delete",
    "list_accelerators",
    "get_accelerator",
    "get_ca",
    "list_tokens",
    "create_tokens",
    "delete_tokens",
    "list_sizes",
    "get_gpu_model_config",
]

MODEL = "qwen/qwen2.5-7b-instruct"
GPU = "gpu-h100x1-80gb"
# The team's own VPC per region (made through the simulated DigitalOcean API by the test).
VPCS = json.loads(os.environ["PYDO_VPCS"])

called = []


def check(condition, what, got=None):
    if not condition:
        detail = "" if got is None else ": " + json.dumps(got, default=str)[:2000]
        raise AssertionError(f"check failed: {what}{detail}")


def client(token):
    """A pydo client for a plain-HTTP test server.

    pydo's default bearer policy refuses to send a token over http://, so the token goes in as a
    plain header instead, which is what every request would carry over https:// anyway.
    """
    return Client(
        token,
        endpoint=os.environ["PYDO_BASE_URL"],
        authentication_policy=HeadersPolicy(
            base_headers={"Authorization": f"Bearer {token}"}
        ),
        retry_total=0,
    )


class Recorder:
    """Wraps `client.dedicated_inferences`, recording every operation called through it."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        method = getattr(self._ops, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            if name not in called:
                called.append(name)
            return method(*args, **kwargs)

        return call


def with_status(pipeline_response, deserialized, headers):
    """A pydo `cls` callback: (HTTP status, body, rate-limit headers)."""
    return pipeline_response.http_response.status_code, deserialized, headers


def spec(name, region, version=1, scale=2, model_id=None, vpc=True):
    deployment = {
        "model_slug": MODEL,
        "model_provider": "hugging_face",
        "workload_config": {},
        "accelerators": [
            {"scale": scale, "type": "prefill_decode", "accelerator_slug": GPU}
        ],
    }
    if model_id is not None:
        deployment["model_id"] = model_id
    return {
        "version": version,
        "name": name,
        "region": region,
        # Without one (`null`, as godo sends): the team's default VPC in the region.
        "vpc": {"uuid": VPCS[region]} if vpc else None,
        "enable_public_endpoint": True,
        "model_deployments": [deployment],
    }


def check_rate_limit_headers(headers, what):
    check(
        isinstance(headers.get("ratelimit-limit"), int)
        and isinstance(headers.get("ratelimit-remaining"), int)
        and isinstance(headers.get("ratelimit-reset"), int),
        f"{what}: pydo reads the ratelimit-* headers as integers",
        headers,
    )


def phase1(di):
    region = "tor1"

    # The catalog: sizes and model configurations.
    sizes = di.list_sizes()
    check(set(sizes["enabled_regions"]) == {"atl1", "nyc2", "tor1"}, "enabled regions", sizes)
    h100 = [s for s in sizes["sizes"] if s["gpu_slug"] == GPU]
    check(len(h100) == 3, "gpu-h100x1-80gb is offered in three regions", sizes)
    check(
        all(s["currency"] == "USD" and float(s["price_per_hour"]) > 0 for s in h100),
        "sizes carry a USD price",
        h100,
    )
    models = di.get_gpu_model_config()
    by_slug = {m["model_slug"]: m for m in models["gpu_model_configs"]}
    check(MODEL in by_slug, f"{MODEL} is in the model config", models)
    check(by_slug[MODEL]["is_gated_model"] is False, "qwen is not gated", by_slug[MODEL])
    check(GPU in by_slug[MODEL]["gpu_slugs"], "qwen runs on the h100", by_slug[MODEL])
    check(
        by_slug["meta-llama/llama-3.1-8b-instruct"]["is_gated_model"] is True,
        "llama is gated",
        models,
    )

    # An empty team lists nothing.
    empty = di.list()
    check(empty["dedicated_inferences"] == [], "a new team has no DIs", empty)
    check(empty["meta"]["total"] == 0, "meta.total is 0", empty)

    # Create: exactly 202 with the DI and its managed token, value shown once.
    status, created, headers = di.create(
        {"spec": spec("pydo-first", region)}, cls=with_status
    )
    check(status == 202, "create answers 202", status)
    check_rate_limit_headers(headers, "create")
    item = created["dedicated_inference"]
    di_id = item["id"]
    check(str(uuid.UUID(di_id)) == di_id, "the DI id is a UUID", item)
    check(item["name"] == "pydo-first", "created name", item)
    check(item["region"] == region, "created region", item)
    check(item["status"] == "new", "a new DI is `new`", item)
    check(item["spec"]["version"] == 1, "the first spec is version 1", item)
    check(
        item["pending_deployment_spec"]["version"] == 1,
        "version 1 is pending until rolled out",
        item,
    )
    deployment = item["spec"]["model_deployments"][0]
    check(deployment["model_slug"] == MODEL, "model slug echoed", deployment)
    check(deployment["accelerators"][0]["scale"] == 2, "scale echoed", deployment)
    uuid.UUID(deployment["model_id"])
    token = created["token"]
    check(token["value"].startswith("di_"), "the managed token value starts with di_", token)
    check(token["is_managed"] is True, "the first token is managed", token)

    # Get: the same DI, and the token value is never shown again.
    got = di.get(di_id)["dedicated_inference"]
    check(got["id"] == di_id, "get returns the created DI", got)
    check(got["status"] == "new", "still new", got)
    check(token["value"] not in json.dumps(got), "the token value is not shown again")

    # Listing sees it.
    listed = di.list(per_page=10, page=1, region=region)
    check(listed["meta"]["total"] == 1, "one DI listed in its region", listed)
    check(listed["dedicated_inferences"][0]["id"] == di_id, "listed id", listed)
    other = di.list(region="atl1")
    check(other["meta"]["total"] == 0, "the region filter applies", other)

    # Error paths through pydo's exception mapping.
    try:
        di.create({"spec": spec("pydo-first", "atl1")})
        raise AssertionError("a duplicate name must be refused")
    except ResourceExistsError as e:
        check(e.status_code == 409, "a duplicate name is 409", e.status_code)
    bad = spec("pydo-bad", region)
    bad["model_deployments"][0]["accelerators"][0]["accelerator_slug"] = "gpu-nonexistent"
    try:
        di.create({"spec": bad})
        raise AssertionError("an unknown accelerator must be refused")
    except HttpResponseError as e:
        check(e.status_code == 422, "an unknown accelerator is 422", e.status_code)
        body = e.response.json()
        check(body["id"] == "unprocessable_entity", "422 error id", body)
    try:
        Recorder(client("dop_v1_" + "0" * 64).dedicated_inferences).list()
        raise AssertionError("an unknown API token must be refused")
    except ClientAuthenticationError as e:
        check(e.status_code == 401, "an unknown token is 401", e.status_code)

    return {"id": di_id, "region": region, "model_id": deployment["model_id"]}


def phase2(di, di_id, region):
    # The worker rolled out version 1: the DI is active with endpoints.
    status, got, headers = di.get(di_id, cls=with_status)
    check(status == 200, "get answers 200", status)
    check_rate_limit_headers(headers, "get")
    item = got["dedicated_inference"]
    check(item["status"] == "active", "rolled out DI is active", item)
    check(item["pending_deployment_spec"] is None, "nothing pending after the rollout", item)
    check(
        item["endpoints"]["public_endpoint_fqdn"] == "pub.pydo.example",
        "public endpoint shown",
        item,
    )
    model_id = item["spec"]["model_deployments"][0]["model_id"]

    # Accelerators, paginated and filtered by slug.
    accs = di.list_accelerators(di_id, per_page=1, page=1)
    check(accs["meta"]["total"] == 2, "two accelerators observed", accs)
    check(len(accs["accelerators"]) == 1, "per_page=1 returns one", accs)
    pages = accs["links"]["pages"]
    check("page=2" in pages.get("next", ""), "a next link to page 2", pages)
    check("page=2" in pages.get("last", ""), "the last page is 2", pages)
    check("prev" not in pages, "no prev link on page 1", pages)
    page2 = di.list_accelerators(di_id, per_page=1, page=2)
    check("prev" in page2["links"]["pages"], "a prev link on page 2", page2)
    both = di.list_accelerators(di_id, slug=GPU)
    check(both["meta"]["total"] == 2, "both are h100s", both)
    names = sorted(a["name"] for a in both["accelerators"])
    check(names == ["pydo-gpu-a", "pydo-gpu-b"], "accelerator names", both)
    none = di.list_accelerators(di_id, slug="gpu-l40sx1-48gb")
    check(none["meta"]["total"] == 0, "the slug filter applies", none)
    first = both["accelerators"][0]
    one = di.get_accelerator(di_id, first["id"])
    check(one["id"] == first["id"], "get_accelerator returns that accelerator", one)
    check(one["name"] == first["name"] and one["slug"] == GPU, "accelerator fields", one)
    check(one["status"] in ("active", "provisioning"), "accelerator status", one)
    status, missing, _ = di.get_accelerator(di_id, str(uuid.uuid4()), cls=with_status)
    check(status == 404 and missing["id"] == "not_found", "unknown accelerator is 404", missing)

    # The CA: base64 of a PEM certificate.
    ca = di.get_ca(di_id)
    pem = base64.b64decode(ca["cert"], validate=True).decode("ascii")
    check(pem.startswith("-----BEGIN CERTIFICATE-----"), "the CA decodes to PEM", pem[:80])
    check(pem.rstrip().endswith("-----END CERTIFICATE-----"), "the CA PEM is complete", pem[-80:])

    # Tokens: list, create (exactly 202, value shown once), revoke (204), revoke again (404).
    tokens = di.list_tokens(di_id)
    check(tokens["meta"]["total"] == 1, "only the managed token so far", tokens)
    check(tokens["tokens"][0]["is_managed"] is True, "the managed token", tokens)
    check("value" not in tokens["tokens"][0], "listed tokens carry no value", tokens)
    status, made, _ = di.create_tokens(di_id, {"name": "pydo-extra"}, cls=with_status)
    check(status == 202, "token create answers 202", status)
    token = made["token"]
    check(token["name"] == "pydo-extra", "token name", token)
    check(token["value"].startswith("di_"), "the token value starts with di_", token)
    check(token["is_managed"] is False, "a created token is not managed", token)
    tokens = di.list_tokens(di_id, per_page=1)
    check(tokens["meta"]["total"] == 2, "two tokens now", tokens)
    check(len(tokens["tokens"]) == 1, "per_page=1 returns one token", tokens)
    check("next" in tokens["links"]["pages"], "a next link for tokens", tokens)
    status, body, _ = di.delete_tokens(di_id, token["id"], cls=with_status)
    check(status == 204 and body is None, "revoking answers 204 without a body", [status, body])
    status, body, _ = di.delete_tokens(di_id, token["id"], cls=with_status)
    check(status == 404 and body["id"] == "not_found", "revoking again is 404", [status, body])
    tokens = di.list_tokens(di_id)
    check(tokens["meta"]["total"] == 1, "back to the managed token", tokens)
    check(
        all(t["id"] != token["id"] for t in tokens["tokens"]),
        "the revoked token is not listed",
        tokens,
    )

    # Patch: carries the latest version and becomes version 2, pending; answers exactly 202.
    status, patched, _ = di.patch(
        di_id,
        {"spec": spec("pydo-renamed", region, version=1, scale=3, model_id=model_id)},
        cls=with_status,
    )
    check(status == 202, "patch answers 202", status)
    item = patched["dedicated_inference"]
    pending = item["pending_deployment_spec"]
    check(pending["name"] == "pydo-renamed", "the pending spec carries the new name", item)
    check(item["status"] == "updating", "a patched active DI is `updating`", item)
    check(pending["version"] == 2, "the version increments to 2", item)
    check(
        pending["model_deployments"][0]["accelerators"][0]["scale"] == 3,
        "the pending spec has the new scale",
        pending,
    )
    check(item["spec"]["version"] == 1, "version 1 still serves", item)
    try:
        di.patch(
            di_id,
            {"spec": spec("pydo-renamed", region, version=1, scale=4, model_id=model_id)},
        )
        raise AssertionError("a stale version must be refused")
    except ResourceExistsError as e:
        check(e.status_code == 409, "a stale version is 409", e.status_code)
    got = di.get(di_id)["dedicated_inference"]
    check(got["pending_deployment_spec"]["version"] == 2, "get shows version 2 pending", got)

    # List with pagination across two DIs.
    second = di.create({"spec": spec("pydo-second", "nyc2", vpc=False)})["dedicated_inference"]
    check(second["vpc_uuid"] not in ("", None, VPCS["nyc2"]), "no VPC: the team's default one", second)
    check(second["spec"]["vpc"]["uuid"] == second["vpc_uuid"], "the DI reports its VPC", second)
    page1 = di.list(per_page=1, page=1)
    check(page1["meta"]["total"] == 2, "two DIs listed", page1)
    check(len(page1["dedicated_inferences"]) == 1, "per_page=1 lists one", page1)
    check("page=2" in page1["links"]["pages"]["next"], "a next link to page 2", page1)
    page2 = di.list(per_page=1, page=2)
    ids = {page1["dedicated_inferences"][0]["id"], page2["dedicated_inferences"][0]["id"]}
    check(ids == {di_id, second["id"]}, "the two pages hold both DIs", [page1, page2])
    check("next" not in page2["links"]["pages"], "no next link on the last page", page2)

    # Delete: 202, the DI shows `deleting`; a random id answers 404.
    status, body, _ = di.delete(second["id"], cls=with_status)
    check(status == 202, "delete answers 202", [status, body])
    gone = di.get(second["id"])["dedicated_inference"]
    check(gone["status"] == "deleting", "a deleted DI is `deleting`", gone)
    status, body, _ = di.delete(str(uuid.uuid4()), cls=with_status)
    check(status == 404 and body["id"] == "not_found", "deleting an unknown DI is 404", body)

    # pydo 0.44.0 lists 404 among get's documented answers: it returns the error body rather
    # than raising. Both the status and DigitalOcean's error shape must be right.
    status, body, _ = di.get(str(uuid.uuid4()), cls=with_status)
    check(status == 404, "an unknown DI is 404", status)
    check(body["id"] == "not_found" and body["message"], "404 error shape", body)
    check(isinstance(body.get("request_id"), str) and body["request_id"], "404 request_id", body)

    # A GET whose 404 pydo does raise for: the same path via send_request + raise_for_status.
    from azure.core.rest import HttpRequest

    response = CLIENT.send_request(
        HttpRequest("GET", f"/v2/dedicated-inferences/{uuid.uuid4()}")
    )
    try:
        response.raise_for_status()
        raise AssertionError("an unknown DI must raise")
    except HttpResponseError as e:
        check(e.status_code == 404, "raise_for_status on an unknown DI is 404", e.status_code)


CLIENT = None


def main():
    global CLIENT
    phase = os.environ["PYDO_PHASE"]
    CLIENT = client(os.environ["PYDO_TOKEN"])
    di = Recorder(CLIENT.dedicated_inferences)
    if phase == "1":
        result = phase1(di)
    elif phase == "2":
        phase2(di, os.environ["PYDO_DI_ID"], os.environ["PYDO_DI_REGION"])
        result = {}
    else:
        raise SystemExit(f"unknown PYDO_PHASE {phase!r}")
    result["phase"] = int(phase)
    result["operations"] = called
    unknown = [op for op in called if op not in ALL_OPERATIONS]
    check(not unknown, "only the 13 dedicated inference operations are used", unknown)
    if phase == "2":
        done = set(json.loads(os.environ.get("PYDO_PHASE1_OPERATIONS", "[]"))) | set(called)
        missing = [op for op in ALL_OPERATIONS if op not in done]
        check(not missing, "every operation was called in one phase or the other", missing)
        print(
            f"pydo compat: {len(done)} operations passed: "
            + ", ".join(op for op in ALL_OPERATIONS if op in done)
        )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        import traceback

        traceback.print_exc()
        sys.exit(1)
