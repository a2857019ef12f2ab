"""The soak: drives the whole system (as `scripts/run` starts it) like many customers at once,
while a chaos loop breaks the simulated cloud and the control plane; checks invariants while it
runs and at the end; prints a report; exits 1 on any violation.

Customers: several teams, each with VPCs of its own in two regions, create DIs (with pydo and
its default retries, in godo's request shape, with and without an Idempotency-Key, from clients
that give up mid-request), patch them (scale, GPU size, model, name, a deployment added or
removed, with and without model ids), create and revoke tokens, and delete them. A probe calls
every DI that has served, throughout its updates. Chaos: DigitalOcean and Kubernetes 5xx, 429
and latency; SIGKILLed workers (two per region, restarted by their supervisor); a regional
service stalled (SIGSTOP) and resumed; central killed and restarted; Postgres restarted
(`pg_ctl restart -m fast`, as a managed database's failover or minor upgrade does); a flood of
made-up bearer tokens against central from the customers' own address. Mid-run, as an operator
upgrades the control plane, the workers restart one at a time with a new model-server image: the
fleet rollout that follows must finish on every active DI without halting, under the same chaos,
while the probe keeps calling them.

Seeded: each actor draws its choices from its own generator, so a seed replays the same choices
(their timing, and so their interleaving, still varies). Run it through `tests/soak/run`.
"""

import argparse
import base64
import collections
import glob
import hashlib
import json
import os
import random
import shutil
import signal
import ssl
import string
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx

# What a deployment serves: (the name clients call it by, the Hugging Face repository when it is
# the customer's own). Two catalog models, and a customer's fine-tune at two repositories under
# one name (published to the simulated Hub at the start).
MODELS = [("qwen/qwen2.5-7b-instruct", ""), ("openai/gpt-oss-20b", ""),
          ("soak-tune", "soak-org/tune-a"), ("soak-tune", "soak-org/tune-b")]
FINE_TUNES = ["soak-org/tune-a", "soak-org/tune-b"]
GPUS = ["gpu-h100x1-80gb", "gpu-h200x1-141gb"]
REGIONS = ["atl1", "nyc2"]
# How long after an induced outage ends a 503 from central is still expected (its region call
# times out after 5 s; a request that started in the outage ends after it).
OUTAGE_GRACE = 8.0
REVOKE_DEADLINE = 5.0
# What chaos injects, one at a time (a fault listed twice is drawn twice as often).
FAULTS = ["do", "kube", "do-429", "kube-429", "latency", "latency", "kill-worker", "kill-worker", "stall-region",
          "restart-central", "restart-postgres", "token-flood"]
# The model-server image the workers roll out mid-run (scripts/run: `<state>/worker.env`).
UPGRADE_IMAGE = "vllm/vllm-openai:v0.19.1-soak-upgrade"
# Why a worker parks a DI in `error` (services/worker: permanent failures, and a stall).
FAILURE_REASONS = {"CapacityExhausted", "InvalidSpec", "CloudRejected", "KubernetesRejected", "Stalled"}


def now():
    return time.monotonic()


BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase


def base62(n, width):
    digits = ""
    for _ in range(width):
        n, d = divmod(n, 62)
        digits = BASE62[d] + digits
    return digits


def made_up_token(rng):
    """A bearer token nobody was given, of one of the kinds a flood sends: junk, the legacy API
    token shape (`dia_v1_` + 40 base62), and the current format (`dia_v3_` + 40 base62 + a MAC in
    14 base62 under central's key, services/common/src/tokens.rs) with a made-up MAC, of a valid
    number or not."""
    random_part = "".join(rng.choice(BASE62) for _ in range(40))
    kind = rng.randrange(4)
    if kind == 0:
        return f"{rng.getrandbits(160):040x}"
    if kind == 1:
        return "dia_v1_" + random_part
    if kind == 2:
        return "dia_v3_" + random_part + "z" * 14
    return "dia_v3_" + random_part + base62(rng.getrandbits(80), 14)


class Soak:
    def __init__(self, args):
        self.args = args
        self.api = args.api.rstrip("/")
        self.state = args.state
        self.stop = threading.Event()
        self.lock = threading.RLock()
        self.violations = []
        self.checks = collections.Counter()  # invariant -> times it was checked, passed or not
        self.counts = collections.Counter()
        self.faults = collections.Counter()
        self.dis = {}  # id -> dict: what customers were told
        self.secrets = set()  # every secret value a log line must never hold
        self.outages = []  # (region or None for all, start, end or None)
        self.kube_faults = []  # (region, start, end or None): the cluster APIs refuse some calls
        self.cloud_faults = []  # (region, start, end or None): its DigitalOcean API fails some calls
        self.db_restarts = []  # (None, start, end or None): Postgres restarting, for every region
        self.customers = []  # every customer, so one can try another team's VPC
        self.started = now()
        self.secrets_env = self.read_secrets_env()
        # The lifecycle's transition table, as the Rust code applies it (api_types::lifecycle).
        with open(os.path.join(os.path.dirname(__file__), "..", "..", "openapi", "lifecycle.json")) as f:
            self.lifecycle = json.load(f)
        self.secrets.update(v for v in self.secrets_env.values() if len(v) >= 12)

    # ------------------------------------------------------------------ bookkeeping

    def violate(self, invariant, detail):
        with self.lock:
            self.checks[invariant] += 1
            self.violations.append((round(now() - self.started, 1), invariant, detail))
        print(f"[{now() - self.started:7.1f}s] VIOLATION {invariant}: {detail}", flush=True)

    def checked(self, invariant, n=1):
        """Counts `n` checks of `invariant` that held (a violation counts itself): the report says
        how often each was checked, and a run that never checked a required one fails."""
        with self.lock:
            self.checks[invariant] += n

    def note(self, di_id, what):
        """Appends to the DI's story, which violations about it quote."""
        with self.lock:
            di = self.dis.get(di_id)
            if di is not None:
                di["story"].append(f"{now() - self.started:.1f}s {what}")

    def story(self, di_id, last=8):
        with self.lock:
            di = self.dis.get(di_id)
            return "; ".join(di["story"][-last:]) if di else ""

    def count(self, what):
        with self.lock:
            self.counts[what] += 1

    def log(self, msg):
        if self.args.verbose:
            print(f"[{now() - self.started:7.1f}s] {msg}", flush=True)

    def read_secrets_env(self):
        out = {}
        with open(os.path.join(self.state, "secrets.env")) as f:
            for line in f:
                if "=" in line:
                    k, v = line.strip().split("=", 1)
                    out[k] = v
        return out

    def outage_begin(self, region):
        with self.lock:
            self.outages.append([region, now(), None])
            return len(self.outages) - 1

    def outage_end(self, i):
        with self.lock:
            self.outages[i][2] = now()

    def in_outage(self, region, t0, t1, cloud=False):
        """Whether an induced outage touching `region` overlapped [t0, t1] (with grace); with
        `cloud`, a fault of its DigitalOcean API too (a create asks it for the team's VPC)."""
        with self.lock:
            windows = self.outages + (self.cloud_faults if cloud else [])
            for r, s, e in windows:
                end = (e if e is not None else now()) + OUTAGE_GRACE
                if (r is None or region is None or r == region) and s <= t1 and t0 <= end:
                    return True
        return False

    def worker_deadline(self, region, since, seconds):
        """`seconds` after `since` for a worker's write to reach a cluster in `region`, counted
        instead from the end of the last induced fault that holds such writes back and lasted
        past `since`: the cluster's API refusing calls, or Postgres restarting (the workers read
        what to write from it)."""
        with self.lock:
            ends = [(e if e is not None else now()) for r, s, e in self.kube_faults + self.db_restarts
                    if r in (None, region) and (e is None or e >= since)]
        return max([since] + ends) + seconds

    def check_5xx(self, resp, region, t0, what, cloud=False):
        """Invariant: no 5xx except 503 with Retry-After during an induced outage."""
        if resp.status_code < 500:
            self.checked("no-unexpected-5xx")
            return
        if resp.status_code == 503 and resp.headers.get("retry-after"):
            if self.in_outage(region, t0, now(), cloud):
                self.checked("no-unexpected-5xx")
                return
            self.violate("no-unexpected-5xx", f"{what}: 503 outside any induced outage: {resp.text[:200]}")
        else:
            self.violate("no-unexpected-5xx", f"{what}: {resp.status_code} {resp.text[:200]}")

    # ------------------------------------------------------------------ set-up

    def mint_team(self):
        team = str(uuid.uuid4())
        out = subprocess.run(
            [os.path.join(self.args.bin, "central"), "mint-token", "--database-url", self.args.central_db,
             "--team", team, "--name", "soak", "--rate-limit-per-hour", "10000000"],
            check=True, capture_output=True, text=True,
            env={**os.environ, "API_TOKEN_KEY": self.secrets_env["API_TOKEN_KEY"]})
        token = out.stdout.strip()
        self.secrets.add(token)
        return team, token

    def sim(self, region):
        return self.args.sims[region]

    def sim_token(self, region):
        return self.secrets_env[f"SIM_TOKEN_{region}"]

    def hugging_face_account(self):
        """A Hugging Face token of a customer's own account, known to the (simulated) Hub: the
        regions refuse a token the Hub rejects."""
        hf = f"hf_soak_{uuid.uuid4().hex}"
        self.secrets.add(hf)
        r = httpx.post(f"{self.args.hub}/_sim/tokens", json={"token": hf, "user": "soak-customer"}, timeout=10)
        r.raise_for_status()
        return hf

    def make_vpc(self, team, region, name):
        """A VPC of `team`'s DigitalOcean account, made as the customer makes one."""
        r = httpx.post(f"{self.sim(region)}/v2/vpcs", json={"name": name, "region": region},
                       headers={"Authorization": f"Bearer {self.sim_token(region)}",
                                "X-Acting-Account": team}, timeout=10)
        r.raise_for_status()
        return r.json()["vpc"]["id"]

    # ------------------------------------------------------------------ requests

    def request(self, client, method, path, region=None, what=None, cloud=False, **kw):
        """One request; returns the response or None when no answer came (connection error or
        the client's timeout). Checks the 5xx invariant."""
        t0 = now()
        try:
            resp = client.request(method, self.api + path, **kw)
        except httpx.HTTPError as e:
            self.count(f"no-answer {what or method}")
            self.log(f"{what or method} {path}: no answer ({type(e).__name__})")
            return None
        self.count(f"{what or method} -> {resp.status_code}")
        self.check_5xx(resp, region, t0, f"{what or method} {path}", cloud)
        if resp.status_code in (401, 429):
            # Every request through here carries a customer's valid API token, far below its
            # rate limit: refused, it was caught up in what a flood of made-up tokens did.
            self.violate("valid-tokens-accepted", f"{what or method} {path}: {resp.status_code} {resp.text[:200]}")
        else:
            self.checked("valid-tokens-accepted")
        return resp

    def retry_after(self, resp):
        try:
            return min(float(resp.headers.get("retry-after", "1")), 5.0)
        except ValueError:
            return 1.0


class Customer(threading.Thread):
    """One customer of a team: owns the DIs it creates and does everything to them in turn. A
    steady one creates a DI in each region, then only manages its tokens: its DIs run unchanged
    by their customer, so the mid-run upgrade reaches them through the fleet rollout alone."""

    def __init__(self, soak, team, token, vpcs, index, steady=False):
        super().__init__(daemon=True, name=f"customer-{index}")
        self.steady = steady
        self.soak = soak
        self.team = team
        self.token = token
        self.vpcs = vpcs  # region -> [vpc ids]
        self.rng = random.Random(soak.args.seed * 1000 + index)
        self.client = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30)
        self.mine = []  # ids of live DIs this customer owns

    # ------------------------------------------------------------------ helpers

    def di(self, di_id):
        return self.soak.dis[di_id]

    def get(self, di_id):
        while not self.soak.stop.is_set() or True:
            resp = self.soak.request(self.client, "GET", f"/v2/dedicated-inferences/{di_id}", what="get")
            if resp is not None and resp.status_code in (200, 404):
                return resp
            time.sleep(1)

    def spec_of(self, body):
        d = body["dedicated_inference"]
        return d.get("pending_deployment_spec") or d["spec"]

    def new_name(self):
        return f"soak-{self.rng.randrange(16**8):08x}"

    # ------------------------------------------------------------------ operations

    def run(self):
        try:
            while not self.soak.stop.is_set():
                self.step()
                time.sleep(self.rng.uniform(0.2, 1.5))
        except Exception as e:  # a bug in the soak itself must not pass silently
            self.soak.violate("soak-driver", f"{self.name} crashed: {e!r}")
            raise

    def step(self):
        live = [i for i in self.mine if not self.di(i)["deleted"]]
        if self.steady:
            if len(self.mine) < len(REGIONS):
                self.create()
            elif live:
                self.tokens(self.rng.choice(live))
            return
        choices = [("create", 3 if len(live) < self.soak.args.dis_per_customer else 0), ("bad-input", 0.5)]
        if live:
            choices += [("patch", 4), ("token", 2), ("delete", 1 if len(live) > 1 else 0.3)]
        op = self.rng.choices([c for c, _ in choices], [w for _, w in choices])[0]
        if op == "create":
            self.create()
        elif op == "bad-input":
            self.bad_input()
        elif op == "patch":
            self.patch(self.rng.choice(live))
        elif op == "token":
            self.tokens(self.rng.choice(live))
        elif op == "delete":
            self.delete(self.rng.choice(live))

    def create_body(self, godo):
        region = REGIONS[len(self.mine)] if self.steady else self.rng.choice(REGIONS)
        vpc = self.rng.choice(self.vpcs[region])
        model, repo = self.rng.choice(MODELS)
        gpu = self.rng.choice(GPUS)
        if self.steady:
            # A catalog model on the first size: nothing about it may fail, so the rollout has
            # a DI to move in each region.
            (model, repo), gpu = MODELS[0], GPUS[0]
        deployment = {"model_slug": model, "model_provider": "hugging_face",
                      "accelerators": [{"scale": 1, "type": "prefill_decode", "accelerator_slug": gpu}]}
        if repo:
            deployment["provider_model_id"] = repo
        spec = {"version": 1, "name": self.new_name(), "region": region,
                "enable_public_endpoint": self.rng.random() < 0.8}
        if godo:
            # godo's shape: provider_model_id always sent, the HF token under `secrets`.
            deployment.setdefault("provider_model_id", "")
        else:
            deployment["workload_config"] = {}
        if self.rng.random() < 0.3:
            # No VPC: the team's default one (godo and Terraform send null when none is set).
            spec["vpc"] = None
        else:
            spec["vpc"] = {"uuid": vpc}
        spec["model_deployments"] = [deployment]
        body = {"spec": spec}
        if self.rng.random() < 0.3:
            hf = self.soak.hugging_face_account()
            body["secrets" if godo else "access_tokens"] = {"hugging_face_token": hf}
        return region, body

    def create(self):
        style = self.rng.choice(["pydo", "godo", "keyed", "impatient"])
        region, body = self.create_body(godo=(style == "godo"))
        name = body["spec"]["name"]
        self.soak.count(f"create[{style}]")
        if style == "pydo":
            created = self.create_with_pydo(body, region)
        else:
            created = self.create_with_retries(body, region, style)
        if created is None:
            return
        di = created["dedicated_inference"]
        token = created["token"]["value"]
        self.soak.secrets.add(token)
        with self.soak.lock:
            self.soak.dis[di["id"]] = {
                "id": di["id"], "team": self.team, "region": region, "name": name, "token": token,
                "api_token": self.token,
                "accepted_version": 1, "expected": body["spec"], "deleted": False, "served": False,
                "tokens": {}, "created_at": now(), "story": [],
            }
        self.soak.note(di["id"], f"created ({style}) {json.dumps(body['spec']['model_deployments'])}")
        self.mine.append(di["id"])
        self.soak.log(f"created {di['id']} ({style}) in {region}")

    def bad_input(self):
        """A request no client should send: it must get a clear 4xx at once, never a 5xx, and
        create nothing (a create of it that the region accepted would show up as a DI no
        customer got a 202 for)."""
        region, body = self.create_body(godo=False)
        kind = self.rng.choice(["deep", "wide", "type", "nul", "huge", "foreign-vpc"])
        others = [c.vpcs[region] for c in self.soak.customers if c.team != self.team]
        if kind == "foreign-vpc" and not others:
            kind = "type"
        if kind == "deep":
            nested = {}
            for _ in range(self.rng.randrange(20, 140)):
                nested = {"a": nested}
            body["spec"]["model_deployments"][0]["workload_config"] = nested
        elif kind == "wide":
            body["spec"]["model_deployments"][0]["workload_config"] = {f"k{i}": "x" * 100 for i in range(300)}
        elif kind == "type":
            body["spec"]["model_deployments"][0]["accelerators"][0]["scale"] = "two"
        elif kind == "nul":
            body["spec"]["name"] = "bad\u0000name"
        elif kind == "foreign-vpc":
            # Another team's VPC (the next team's): refused, never a DI in someone else's network.
            body["spec"]["vpc"] = {"uuid": self.rng.choice(self.rng.choice(others))}
        else:
            body["spec"]["model_deployments"][0]["workload_config"] = {"blob": "x" * 70000}
        self.soak.count(f"bad-input[{kind}]")
        resp = self.soak.request(self.client, "POST", "/v2/dedicated-inferences", region=region,
                                 what="bad-input", cloud=True, json=body)
        if resp is not None and resp.status_code < 400:
            self.soak.violate("bad-input-refused", f"{kind}: {resp.status_code} {resp.text[:200]}")
        elif resp is not None:
            self.soak.checked("bad-input-refused")

    def create_with_pydo(self, body, region):
        import pydo
        from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError
        from azure.core.pipeline.policies import HeadersPolicy
        client = pydo.Client(self.token, endpoint=self.soak.api,
                             authentication_policy=HeadersPolicy(
                                 base_headers={"Authorization": f"Bearer {self.token}"}))
        t0 = now()
        try:
            created = client.dedicated_inferences.create(body=body)
            self.soak.checked("no-unexpected-4xx")
            return created
        except HttpResponseError as e:
            status = e.status_code
            self.soak.count(f"pydo create -> {status}")
            if status == 409:
                # pydo only retries 5xx and lost connections: a 409 for a name this customer
                # picked fresh means an earlier attempt of this very call made the DI.
                self.soak.violate("retries-find-their-create",
                                  f"pydo create {body['spec']['name']}: 409 after its own retries: {e.message}")
            elif status >= 500 and not (status == 503 and self.soak.in_outage(region, t0, now(), cloud=True)):
                self.soak.violate("no-unexpected-5xx", f"pydo create: {status} {e.message}")
            elif status < 500:
                self.soak.violate("no-unexpected-4xx", f"pydo create: {status} {e.message}")
            return None
        except (ServiceRequestError, ServiceResponseError):
            # No answer: never sent, or sent and its answer lost (pydo does not retry a POST
            # whose connection dropped mid-answer, as when central restarts). A customer sends
            # the same create again, which must find the one that may have been made.
            self.soak.count("pydo create -> no answer")
            return self.create_with_retries(body, region, "after-pydo")

    def create_with_retries(self, body, region, style):
        """godo's retry policy (5xx and 429, honouring Retry-After), as a plain loop: the same body
        again, with the same key when there is one. The impatient client gives up after 20 to 300 ms
        on its first try, as a client with a short timeout or a dropped connection does: most
        creates take longer than the shortest of those, so every run retries some creates whose
        first attempt may have landed (what `retries-find-their-create` checks)."""
        headers = {}
        if style == "keyed":
            headers["Idempotency-Key"] = f"soak-{uuid.uuid4()}"
        unanswered = style == "after-pydo"  # pydo's own attempts got no answer
        deadline = now() + 120
        first = True
        while now() < deadline:
            timeout = self.rng.uniform(0.02, 0.3) if (style == "impatient" and first) else 30
            first = False
            resp = self.soak.request(self.client, "POST", "/v2/dedicated-inferences", region=region,
                                     what="create", cloud=True, json=body, headers=headers, timeout=timeout)
            if resp is None:
                unanswered = True
                time.sleep(1)
                continue
            if resp.status_code == 202:
                self.soak.checked("no-unexpected-4xx")
                if unanswered:
                    self.soak.checked("retries-find-their-create")
                if style == "keyed":
                    self.soak.checked("keys-finish")
                return resp.json()
            if resp.status_code in (429,) or resp.status_code >= 500:
                unanswered = True
                time.sleep(self.soak.retry_after(resp))
                continue
            if resp.status_code == 409 and "in progress" in resp.text:
                time.sleep(1)
                continue
            if resp.status_code == 409 and unanswered:
                self.soak.violate("retries-find-their-create",
                                  f"create {body['spec']['name']} ({style}): retried after no answer, got 409: {resp.text[:200]}")
                return None
            self.soak.violate("no-unexpected-4xx", f"create ({style}): {resp.status_code} {resp.text[:200]}")
            return None
        self.soak.violate("retries-find-their-create", f"create {body['spec']['name']} ({style}): no 202 within 120 s")
        return None

    def patch(self, di_id, kind=None):
        if kind is None:
            kind = self.rng.choice(["scale", "scale", "gpu", "model", "name", "add-or-remove", "move-then-scale"])
        if kind == "move-then-scale":
            # A GPU move, then a scale change while the new pool's nodes are still joining
            # (the simulator's nodes take 2 s): the interleaving behind an outage the soak once
            # found only by chance, when a scale-down's pass removed the node a waiting pod of
            # the move was being placed on.
            self.soak.count("patch[move-then-scale]")
            self.patch(di_id, "gpu")
            time.sleep(self.rng.uniform(0.3, 3.0))
            kind = "scale"
        resp = self.get(di_id)
        if resp.status_code == 404:
            self.soak.violate("one-effect-per-2xx", f"DI {di_id} created with 202 is 404 before any delete")
            self.di(di_id)["deleted"] = True
            return
        body = resp.json()
        spec = json.loads(json.dumps(self.spec_of(body)))
        deployments = spec["model_deployments"]
        if kind == "add-or-remove":
            kind = "add" if len(deployments) == 1 else "remove"
        if kind == "scale":
            acc = deployments[0]["accelerators"][0]
            acc["scale"] = 1 if acc["scale"] >= 2 else 2
        elif kind == "gpu":
            acc = deployments[0]["accelerators"][0]
            acc["accelerator_slug"] = GPUS[1] if acc["accelerator_slug"] == GPUS[0] else GPUS[0]
        elif kind == "model":
            current = (deployments[0]["model_slug"], deployments[0].get("provider_model_id") or "")
            taken = {d["model_slug"] for d in deployments[1:]}
            choices = [m for m in MODELS if m != current and m[0] not in taken]
            deployments[0]["model_slug"], deployments[0]["provider_model_id"] = self.rng.choice(choices)
        elif kind == "name":
            spec["name"] = self.new_name()
        elif kind == "add":
            other, repo = self.rng.choice([m for m in MODELS if m[0] != deployments[0]["model_slug"]])
            deployments.append({"model_slug": other, "model_provider": "hugging_face", "provider_model_id": repo,
                                "accelerators": [{"scale": 1, "type": "prefill_decode", "accelerator_slug": GPUS[0]}]})
        else:
            deployments.pop()
        keep_ids = self.rng.random() < 0.5
        out_deployments = []
        for d in deployments:
            o = {"model_slug": d["model_slug"], "model_provider": d.get("model_provider", "hugging_face"),
                 "accelerators": [{"scale": a["scale"], "type": a.get("type", "prefill_decode"),
                                   "accelerator_slug": a["accelerator_slug"]} for a in d["accelerators"]]}
            if keep_ids and d.get("model_id"):
                o["model_id"] = d["model_id"]
            if d.get("provider_model_id"):
                o["provider_model_id"] = d["provider_model_id"]
            out_deployments.append(o)
        di = self.di(di_id)
        out = {"version": spec["version"], "name": spec.get("name") or body["dedicated_inference"]["name"],
               "region": di["region"], "enable_public_endpoint": spec["enable_public_endpoint"],
               "vpc": {"uuid": body["dedicated_inference"]["vpc_uuid"]}, "model_deployments": out_deployments}
        headers = {}
        keyed = self.rng.random() < 0.4
        if keyed:
            headers["Idempotency-Key"] = f"soak-{uuid.uuid4()}"
        impatient = self.rng.random() < 0.2
        self.soak.count(f"patch[{kind}{',keyed' if keyed else ''}{',impatient' if impatient else ''}]")
        # Until this call ends, the PATCH may land at any moment (an attempt without an answer
        # may still be applied): its model may be the one the endpoint serves.
        model = out["model_deployments"][0]["model_slug"]
        with self.soak.lock:
            self.di(di_id).setdefault("under_way", []).append(model)
        try:
            self.send_patch(di_id, out, kind, keyed, impatient, headers)
        finally:
            with self.soak.lock:
                self.di(di_id)["under_way"].remove(model)

    def send_patch(self, di_id, out, kind, keyed, impatient, headers):
        di = self.di(di_id)
        deadline = now() + 90
        first = True
        unanswered = False
        while now() < deadline:
            timeout = 0.3 if (impatient and first) else 30
            first = False
            resp = self.soak.request(self.client, "PATCH", f"/v2/dedicated-inferences/{di_id}", region=di["region"],
                                     what="patch", json={"spec": out}, headers=headers, timeout=timeout)
            if resp is None or resp.status_code == 429 or resp.status_code >= 500:
                unanswered = True
                if not keyed:
                    # Without a key a client cannot tell whether its PATCH landed: read it back.
                    back = self.get(di_id)
                    if back.status_code == 200 and self.spec_of(back.json())["version"] == out["version"] + 1:
                        self.accept(di_id, out)
                        return
                time.sleep(self.soak.retry_after(resp) if resp is not None else 1)
                continue
            if resp.status_code == 202:
                got = resp.json()["dedicated_inference"]
                pending = got.get("pending_deployment_spec") or got["spec"]
                if pending["version"] != out["version"] + 1:
                    self.soak.violate("one-effect-per-2xx", f"patch {di_id} v{out['version']} answered version {pending['version']}")
                else:
                    self.soak.checked("one-effect-per-2xx")
                self.soak.checked("no-unexpected-4xx")
                if keyed:
                    self.soak.checked("keys-finish")
                self.accept(di_id, out)
                return
            if resp.status_code == 409 and "in progress" in resp.text:
                time.sleep(1)
                continue
            if resp.status_code == 409 and "stale" in resp.text:
                if unanswered and not keyed:
                    # An earlier attempt landed (this customer is the DI's only writer): once
                    # central's view shows it, it is the accepted spec.
                    if self.landed(di_id, out["version"] + 1):
                        self.accept(di_id, out)
                        return
                    self.soak.violate("one-effect-per-2xx", f"patch {di_id}: stale, yet v{out['version'] + 1} never shows")
                    return
                self.soak.violate("one-effect-per-2xx", f"patch {di_id}: stale version though this customer is its only writer: {resp.text[:200]}")
                return
            self.soak.violate("no-unexpected-4xx", f"patch {di_id} ({kind}): {resp.status_code} {resp.text[:300]}")
            return
        self.soak.violate("keys-finish", f"patch {di_id} ({kind}, keyed={keyed}): no answer within 90 s")

    def landed(self, di_id, version):
        """Whether the DI shows spec `version` (or newer) within 30 s."""
        deadline = now() + 30
        while now() < deadline:
            back = self.get(di_id)
            if back.status_code == 200 and self.spec_of(back.json())["version"] >= version:
                return True
            time.sleep(0.5)
        return False

    def accept(self, di_id, spec):
        self.soak.note(di_id, f"patch accepted v{spec['version'] + 1}: {spec['name']} "
                       + json.dumps([(d['model_slug'], d['accelerators'][0]['accelerator_slug'], d['accelerators'][0]['scale'],
                                      'id' if d.get('model_id') else 'no id') for d in spec['model_deployments']]))
        with self.soak.lock:
            di = self.di(di_id)
            # A superseded spec may have started to roll out: its model may answer until the
            # newest one has rolled out.
            di.setdefault("in_flight", []).append(spec["model_deployments"][0]["model_slug"])
            di["accepted_version"] = spec["version"] + 1
            di["expected"] = spec
            di["name"] = spec["name"]

    def tokens(self, di_id):
        di = self.di(di_id)
        live = [t for t, v in di["tokens"].items() if v["revoked_at"] is None]
        if live and self.rng.random() < 0.6:
            self.revoke(di_id, self.rng.choice(live))
            return
        self.soak.count("token create")
        deadline = now() + 60
        key = f"soak-{uuid.uuid4()}"
        while now() < deadline:
            resp = self.soak.request(self.client, "POST", f"/v2/dedicated-inferences/{di_id}/tokens",
                                     region=di["region"], what="token-create", json={"name": "soak"},
                                     headers={"Idempotency-Key": key})
            if resp is None or resp.status_code == 429 or resp.status_code >= 500:
                time.sleep(self.soak.retry_after(resp) if resp is not None else 1)
                continue
            if resp.status_code == 409 and "in progress" in resp.text:
                time.sleep(1)
                continue
            if resp.status_code != 202:
                self.soak.violate("no-unexpected-4xx", f"token create {di_id}: {resp.status_code} {resp.text[:200]}")
                return
            self.soak.checked("keys-finish")
            self.soak.checked("no-unexpected-4xx")
            t = resp.json()["token"]
            self.soak.secrets.add(t["value"])
            with self.soak.lock:
                di["tokens"][t["id"]] = {"value": t["value"], "created_at": now(), "revoked_at": None}
            return
        self.soak.violate("keys-finish", f"token create on {di_id}: no answer within 60 s")

    def revoke(self, di_id, token_id):
        di = self.di(di_id)
        self.soak.count("token revoke")
        deadline = now() + 60
        while now() < deadline:
            resp = self.soak.request(self.client, "DELETE", f"/v2/dedicated-inferences/{di_id}/tokens/{token_id}",
                                     region=di["region"], what="token-revoke")
            if resp is None or resp.status_code == 429 or resp.status_code >= 500:
                time.sleep(self.soak.retry_after(resp) if resp is not None else 1)
                continue
            if resp.status_code in (204, 404):
                self.soak.checked("keys-finish")
                self.soak.checked("no-unexpected-4xx")
                # 404: an earlier attempt whose answer was lost revoked it.
                with self.soak.lock:
                    token = di["tokens"][token_id]
                    token["revoked_at"] = now()
                if di.get("served") and not di["deleted"]:
                    token["checked"] = True
                    RevocationCheck(self.soak, di, token_id, token).start()
                return
            self.soak.violate("no-unexpected-4xx", f"revoke {di_id}: {resp.status_code} {resp.text[:200]}")
            return
        self.soak.violate("keys-finish", f"revoke on {di_id}: no answer within 60 s")

    def delete(self, di_id):
        di = self.di(di_id)
        with self.soak.lock:
            di["deleted"] = True  # the probe stops calling it from now on
        self.soak.count("delete")
        delete_di(self.soak, self.client, di)


def delete_di(soak, client, di):
    deadline = now() + 90
    while now() < deadline:
        resp = soak.request(client, "DELETE", f"/v2/dedicated-inferences/{di['id']}", region=di["region"], what="delete")
        if resp is not None and resp.status_code in (202, 404):
            di["deleted_at"] = now()
            return
        time.sleep(soak.retry_after(resp) if resp is not None else 1)
    soak.violate("one-effect-per-2xx", f"delete {di['id']}: no 202 within 90 s")


class RevocationCheck(threading.Thread):
    """From the moment a revoke returned, calls the DI's endpoint with the revoked token every
    100 ms: it must be refused (401) within 5 s, whatever the DI's status."""

    def __init__(self, soak, di, token_id, token):
        super().__init__(daemon=True, name=f"revocation-{token_id[:8]}")
        self.soak, self.di, self.token_id, self.token = soak, di, token_id, token

    def run(self):
        di, soak = self.di, self.soak
        client = httpx.Client(headers={"Authorization": f"Bearer {di['api_token']}"}, timeout=5)
        r = soak.request(client, "GET", f"/v2/dedicated-inferences/{di['id']}", what="revocation-check")
        ca = soak.request(client, "GET", f"/v2/dedicated-inferences/{di['id']}/ca", what="revocation-check")
        if r is None or r.status_code != 200 or ca is None or ca.status_code != 200:
            return  # the API is in an induced outage: the watcher's checks cover this token
        d = r.json()["dedicated_inference"]
        endpoint = (d.get("endpoints") or {}).get("public_endpoint_fqdn") or (d.get("endpoints") or {}).get("private_endpoint_fqdn")
        if not endpoint:
            return
        f = tempfile.NamedTemporaryFile("w", suffix=".pem", delete=False)
        f.write(base64.b64decode(ca.json()["cert"]).decode())
        f.close()
        endpoint_client = httpx.Client(verify=ssl.create_default_context(cafile=f.name), timeout=5)
        model = d["spec"]["model_deployments"][0]["model_slug"]
        last = None

        def deadline():
            # No write reaches a cluster whose API refuses it, nor leaves a worker whose database
            # is restarting: while such a fault lasts, the 5 s count from its end.
            return soak.worker_deadline(di["region"], self.token["revoked_at"], REVOKE_DEADLINE)

        while now() <= deadline():
            if di["deleted"]:
                return
            try:
                last = endpoint_client.post(endpoint + "/v1/chat/completions",
                                            headers={"Authorization": f"Bearer {self.token['value']}"},
                                            json={"model": model, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}]}).status_code
            except httpx.HTTPError:
                last = None
            if last == 401:
                self.token["settled"] = True
                soak.count("revoked token refused")
                soak.checked("revocation-within-5s")
                if now() - self.token["revoked_at"] > REVOKE_DEADLINE:
                    soak.count("revoked token refused only after a fault ended")
                return
            time.sleep(0.1)
        if last is not None and not di["deleted"]:
            self.token["settled"] = True
            soak.violate("revocation-within-5s", f"{di['id']}: token {self.token_id} still answered {last} "
                         f"{now() - self.token['revoked_at']:.1f}s after its revoke returned; story: {soak.story(di['id'])}")


class Watcher(threading.Thread):
    """Follows every DI as its customer sees it (GET), and probes the endpoints of those that
    have served: every call must succeed through updates, a revoked token must be refused within
    5 s, a created one accepted within 10 s."""

    def __init__(self, soak):
        super().__init__(daemon=True, name="watcher")
        self.soak = soak
        self.clients = {}  # team token -> httpx client
        self.endpoint_clients = {}  # di id -> httpx client trusting its CA
        self.seen = {}  # di id -> last GET body

    def api(self, di):
        c = self.clients.get(di["api_token"])
        if c is None:
            c = self.clients[di["api_token"]] = httpx.Client(
                headers={"Authorization": f"Bearer {di['api_token']}"}, timeout=10)
        return c

    def endpoint_client(self, di):
        c = self.endpoint_clients.get(di["id"])
        if c is None:
            resp = self.soak.request(self.api(di), "GET", f"/v2/dedicated-inferences/{di['id']}/ca",
                                     region=di["region"], what="ca")
            if resp is None or resp.status_code != 200:
                return None
            pem = base64.b64decode(resp.json()["cert"]).decode()
            f = tempfile.NamedTemporaryFile("w", suffix=".pem", delete=False)
            f.write(pem)
            f.close()
            c = self.endpoint_clients[di["id"]] = httpx.Client(
                verify=ssl.create_default_context(cafile=f.name), timeout=5)
        return c

    def run(self):
        while not self.soak.stop.is_set():
            with self.soak.lock:
                dis = [d for d in self.soak.dis.values() if not d["deleted"]]
            for di in dis:
                if self.soak.stop.is_set():
                    break
                self.watch(di)
            time.sleep(0.1)

    def watch(self, di):
        resp = self.soak.request(self.api(di), "GET", f"/v2/dedicated-inferences/{di['id']}", what="watch")
        if resp is None or resp.status_code != 200 or di["deleted"]:
            return
        d = resp.json()["dedicated_inference"]
        self.seen[di["id"]] = d
        if d["status"] != di.get("last_status"):
            self.soak.note(di["id"], f"seen {d['status']}")
            previous = di.get("last_status")
            if previous is not None and d["status"] not in self.soak.lifecycle[previous]["reachable"]:
                self.soak.violate("lifecycle", f"{di['id']}: {previous} → {d['status']}, which the transition "
                                  f"table does not allow; story: {self.soak.story(di['id'])}")
            elif previous is not None:
                self.soak.checked("lifecycle")
            di["last_status"] = d["status"]
        if d["status"] == "active" and not di["served"]:
            di["served"] = True
        if not di["served"]:
            return
        endpoint = (d.get("endpoints") or {}).get("public_endpoint_fqdn") or (d.get("endpoints") or {}).get("private_endpoint_fqdn")
        client = self.endpoint_client(di)
        if not endpoint or client is None:
            return
        models = [d["spec"]["model_deployments"][0]["model_slug"]] if d.get("spec") else []
        pending = d.get("pending_deployment_spec")
        if pending:
            models.append(pending["model_deployments"][0]["model_slug"])
            models += di.get("in_flight", [])
        elif d["status"] == "active":
            di["in_flight"] = []  # everything accepted has rolled out
        models += di.get("under_way", [])
        models = list(dict.fromkeys(models))
        self.probe(di, client, endpoint, models)
        for token_id, t in list(di["tokens"].items()):
            self.check_token(di, client, endpoint, models, token_id, t)

    def chat(self, client, endpoint, token, model):
        try:
            r = client.post(endpoint + "/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                            json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            return r.status_code, r.text[:200]
        except httpx.HTTPError as e:
            return None, repr(e)[:200]

    def probe(self, di, client, endpoint, models):
        answers = []
        for model in models:
            status, text = self.chat(client, endpoint, di["token"], model)
            answers.append((model, status, text))
            if status == 200:
                self.soak.count("probe ok")
                if self.seen[di["id"]]["status"] == "updating":
                    # What the invariant is about: a call answered while an update rolls out.
                    self.soak.checked("serving-through-updates")
                return
            if not (status == 404 and "does not exist" in text):
                break  # only an unknown model may be tried with the other name
        if di["deleted"]:
            return  # deleted while this probe ran
        self.soak.count("probe failed")
        self.soak.violate("serving-through-updates", f"{di['id']} ({self.seen[di['id']]['status']}): {answers}; "
                          f"story: {self.soak.story(di['id'])}")

    def check_token(self, di, client, endpoint, models, token_id, t):
        if t.get("settled") or t.get("checked"):
            return  # settled, or a RevocationCheck follows it closely
        status, _ = self.chat(client, endpoint, t["value"], models[-1])
        if di["deleted"] or status is None:
            # Deleted while this call ran, or no answer at all (the probe judges availability):
            # neither says whether the token is still accepted.
            return
        if t["revoked_at"] is not None:
            if status == 401:
                t["settled"] = True
                self.soak.count("revoked token refused")
                self.soak.checked("revocation-within-5s")
            elif now() > self.soak.worker_deadline(di["region"], t["revoked_at"], REVOKE_DEADLINE):
                t["settled"] = True
                self.soak.violate("revocation-within-5s", f"{di['id']}: token {token_id} still answered {status} "
                                  f"{now() - t['revoked_at']:.1f}s after its revoke returned (status {self.seen[di['id']]['status']})")
        elif status == 200:
            t["accepted"] = True
        elif (not t.get("accepted") and status == 401
              and now() > self.soak.worker_deadline(di["region"], t["created_at"], 10)):
            t["settled"] = True
            self.soak.violate("one-effect-per-2xx", f"{di['id']}: token {token_id} created (202) still refused after 10 s")


class Chaos(threading.Thread):
    """Breaks one thing at a time, at random, and puts it right again."""

    def __init__(self, soak):
        super().__init__(daemon=True, name="chaos")
        self.soak = soak
        self.rng = random.Random(soak.args.seed)
        self.sequence = []  # what was injected, in order: one seed gives the same sequence

    def fingerprint(self):
        """A short digest of the fault sequence, to compare two runs of one seed by."""
        return hashlib.sha256(json.dumps(self.sequence).encode()).hexdigest()[:12]

    def pids(self, name):
        """Live pids of the service binaries called `name`, newest first (from the run's pid
        file; a pid is taken only while it is still a process running that binary, never a
        reused id or a thread)."""
        binary = os.path.realpath(os.path.join(self.soak.args.bin, name))
        out = []
        with open(os.path.join(self.soak.state, "run.pids")) as f:
            for line in f:
                pid, n = line.split()
                if n != name:
                    continue
                try:
                    exe = os.readlink(f"/proc/{pid}/exe")
                    tgid = next(l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("Tgid:"))
                except (OSError, StopIteration):
                    continue
                if exe == binary and tgid == pid:
                    out.append(int(pid))
        return out[::-1]

    def regional_pid(self, region):
        for pid in self.pids("regional"):
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"REGION={region}".encode() in env:
                return pid
        return None

    def set_faults(self, region, faults):
        """Sets the simulator's faults on top of the DigitalOcean API's everyday latency (what
        the real API takes; tests/soak/run starts the simulators with it too): the time between
        a pass's look at the cloud and what it does is where the world moves under a decision."""
        merged = {"do": {"latency_ms": self.soak.args.do_latency_ms}}
        for api, f in faults.items():
            merged[api] = {**merged.get(api, {}), **f}
            if api == "do":
                merged[api]["latency_ms"] = max(f.get("latency_ms", 0), self.soak.args.do_latency_ms)
        httpx.put(f"{self.soak.sim(region)}/_sim/faults", json=merged, timeout=10).raise_for_status()

    def run(self):
        while not self.soak.stop.wait(self.rng.uniform(4, 10)):
            kind = self.rng.choice(self.soak.args.faults)
            region = self.rng.choice(REGIONS)
            self.sequence.append([kind, region])
            self.soak.faults[kind] += 1
            self.soak.log(f"chaos: {kind} in {region}")
            try:
                self.inject(kind, region)
            except Exception as e:
                self.soak.violate("soak-driver", f"chaos {kind}: {e!r}")

    def inject(self, kind, region):
        if kind in ("do", "kube", "do-429", "kube-429", "latency"):
            api = "kube" if kind.startswith("kube") else "do"
            f = {"error_rate": 0.3, "rate_limit_rate": 0.0, "latency_ms": 0, "retry_after_secs": 1}
            if kind.endswith("-429"):
                f = {"error_rate": 0.0, "rate_limit_rate": 0.4, "latency_ms": 0, "retry_after_secs": 1}
            if kind == "latency":
                # A slow API widens the time between a pass's look at the cluster and what it
                # does: the window in which the world moves under a decision.
                f = {"error_rate": 0.0, "rate_limit_rate": 0.0, "latency_ms": self.rng.choice([300, 800, 2000]),
                     "retry_after_secs": 1}
                api = self.rng.choice(["do", "kube"])
            # The simulator draws which calls fail from this seed: a seed replays the faults
            # at the same calls (the same calls in the same order, that is; timing still varies).
            f["seed"] = self.rng.getrandbits(63)
            self.sequence[-1] += [api, f]
            windows = self.soak.kube_faults if api == "kube" else self.soak.cloud_faults
            with self.soak.lock:
                windows.append([region, now(), None])
                window = len(windows) - 1
            self.set_faults(region, {api: f})
            self.soak.stop.wait(self.rng.uniform(5, 12))
            self.set_faults(region, {})
            with self.soak.lock:
                windows[window][2] = now()
        elif kind == "kill-worker":
            # One draw whatever the number of live workers, so that the sequence stays the seed's.
            pick = self.rng.random()
            pids = self.pids("worker")
            if pids:
                os.kill(pids[int(pick * len(pids))], signal.SIGKILL)
        elif kind == "stall-region":
            pid = self.regional_pid(region)
            if pid:
                outage = self.soak.outage_begin(region)
                os.kill(pid, signal.SIGSTOP)
                try:
                    self.soak.stop.wait(7)
                finally:
                    os.kill(pid, signal.SIGCONT)
                    self.soak.outage_end(outage)
        elif kind == "token-flood":
            self.token_flood()
        elif kind == "restart-central":
            pids = self.pids("central")
            if pids:
                outage = self.soak.outage_begin(None)
                os.kill(pids[0], signal.SIGKILL)
                for _ in range(100):
                    try:
                        if httpx.get(self.soak.api + "/healthz", timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.2)
                self.soak.outage_end(outage)
        elif kind == "restart-postgres":
            # Every database at once (scripts/run keeps them in one server): central's and each
            # region's services and workers lose their connections and must reconnect alone.
            with self.soak.lock:
                self.soak.db_restarts.append([None, now(), None])
                window = len(self.soak.db_restarts) - 1
            outage = self.soak.outage_begin(None)
            try:
                self.restart_postgres()
            finally:
                self.soak.outage_end(outage)
                with self.soak.lock:
                    self.soak.db_restarts[window][2] = now()

    def restart_postgres(self):
        """`pg_ctl restart -m fast` on the run's Postgres (scripts/run: `<state>/pg/data`), as
        its owner, found as scripts/postgres.sh finds it."""
        pg_ctl = shutil.which("pg_ctl") or max(
            glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
            key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0)
        pg = os.path.join(self.soak.state, "pg")
        command = [pg_ctl, "-D", os.path.join(pg, "data"), "-l", os.path.join(pg, "server.log"),
                   "-w", "-t", "60", "restart", "-m", "fast"]
        if os.getuid() == 0:
            command = ["runuser", "-u", "postgres", "--"] + command
        subprocess.run(command, check=True, capture_output=True, timeout=90)

    def token_flood(self):
        """For 5 to 10 s, four threads send made-up bearer tokens to central as fast as it answers,
        from 127.0.0.1 like every customer (one address, as customers behind an attacker's NAT).
        Each must be refused: 401, or 429 with Retry-After once the address's failure budget is
        spent. The customers' requests meanwhile must keep succeeding (`valid-tokens-accepted`):
        central budgets failures, not successes, and tokens it knows keep working."""
        deadline = now() + self.rng.uniform(5, 10)
        answers = []

        def flood(seed):
            rng, seen = random.Random(seed), collections.Counter()
            with httpx.Client(timeout=10) as client:
                while now() < deadline and not self.soak.stop.is_set():
                    try:
                        r = client.get(self.soak.api + "/v2/dedicated-inferences",
                                       headers={"Authorization": f"Bearer {made_up_token(rng)}"})
                    except httpx.HTTPError:
                        seen["no answer"] += 1
                        continue
                    seen[r.status_code] += 1
                    if r.status_code not in (401, 429) or (r.status_code == 429 and not r.headers.get("retry-after")):
                        self.soak.violate("made-up-tokens-refused", f"{r.status_code} {r.text[:200]}")
                    else:
                        self.soak.checked("made-up-tokens-refused")
            answers.append(seen)

        threads = [threading.Thread(target=flood, args=(self.rng.random(),), daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for status, n in sum(answers, collections.Counter()).items():
            with self.soak.lock:
                self.soak.counts[f"made-up token -> {status}"] += n

    def heal(self):
        for region in REGIONS:
            try:
                self.set_faults(region, {})
            except httpx.HTTPError:
                pass
            pid = self.regional_pid(region)
            if pid:
                os.kill(pid, signal.SIGCONT)


class Upgrade(threading.Thread):
    """An operator's rolling upgrade of the workers, 40% into the run: a new model-server image
    in `<state>/worker.env`, then each worker stopped (SIGTERM) and started again by its
    supervisor with it, one at a time, each once its replacement runs."""

    def __init__(self, soak, chaos, steady):
        super().__init__(daemon=True, name="upgrade")
        self.soak = soak
        self.chaos = chaos
        self.steady = steady
        self.done = False
        # The steady customer's DIs active before the upgrade: only the rollout may restart them.
        self.active_before = []

    def run(self):
        if self.soak.stop.wait(self.soak.args.seconds * 0.4):
            return
        for di_id in list(self.steady.mine):
            resp = self.steady.get(di_id)
            body = resp.json().get("dedicated_inference", {}) if resp.status_code == 200 else {}
            if body.get("status") == "active" and body.get("pending_deployment_spec") is None:
                self.active_before.append(di_id)
        self.soak.log(f"upgrade: the workers restart one at a time with {UPGRADE_IMAGE}")
        with open(os.path.join(self.soak.state, "worker.env"), "w") as f:
            f.write(f"VLLM_IMAGE={UPGRADE_IMAGE}\n")
        old = self.chaos.pids("worker")
        for pid in old:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue  # killed by chaos meanwhile: it starts with the new settings
            deadline = now() + 60
            while now() < deadline and (pid in self.chaos.pids("worker") or len(self.chaos.pids("worker")) < len(old)):
                # Real time: another process restarting, seen only through its pid.
                time.sleep(0.2)
        self.done = True
        self.soak.log("upgrade: every worker restarted")


def rollout_finished(soak, upgrade):
    """After the upgrade, each region's newest rollout finishes without halting: every active
    DI's model servers run the new image, and `regional fleet status` shows no failed DI. A DI
    active before the upgrade and left unchanged by its customer (the steady one's) moved under
    the rollout's budget: it carries the rollout's `PlatformUpdated` event."""
    active = {d["id"] for d in soak.dis.values() if d.get("outcome") == "active"}
    for di_id in upgrade.active_before:
        if di_id not in active:
            continue
        reasons, page = [], 1
        while True:  # every page: each token change is an event too
            ev = soak.request(upgrade.steady.client, "GET",
                              f"/v2/dedicated-inferences/{di_id}/events?per_page=200&page={page}", what="settle")
            if ev is None or ev.status_code != 200:
                reasons = None
                break
            events = ev.json()["events"]
            reasons += [e["reason"] for e in events]
            if len(events) < 200:
                break
            page += 1
        if reasons is None:
            continue
        if "PlatformUpdated" in reasons:
            soak.checked("rollout-finishes")
        else:
            soak.violate("rollout-finishes", f"{di_id} was active before the upgrade and moved outside the "
                         f"fleet rollout: events {reasons[-8:]}")
    pg = soak.args.central_db.rsplit("/", 1)[0]
    deadline = now() + soak.args.settle
    for region in REGIONS:
        behind = None
        while now() < deadline:
            inv = httpx.get(f"{soak.sim(region)}/_sim/inventory", timeout=30).json()
            behind = sorted(
                f"{o['metadata']['namespace']}/{o['metadata']['name']}: {c.get('image')}"
                for objs in inv["kubernetes"].values() for o in objs
                if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("vllm-")
                and o["metadata"].get("labels", {}).get("dedicated-inference.dev/id") in active
                for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"
                and c.get("image") != UPGRADE_IMAGE)
            if not behind:
                break
            # Real time: the simulator's inventory, polled from outside as an operator would.
            time.sleep(2)
        status = subprocess.run([os.path.join(soak.args.bin, "regional"), "fleet", "status"],
                                env={**os.environ, "DATABASE_URL": f"{pg}/region_{region}"},
                                capture_output=True, text=True, timeout=60)
        rollouts = json.loads(status.stdout) if status.returncode == 0 else None
        newest = rollouts[0] if rollouts else None
        if behind:
            soak.violate("rollout-finishes", f"{region}: {len(behind)} model servers not on the new image "
                         f"within {soak.args.settle:.0f}s, e.g. {behind[:3]}; rollouts: {rollouts}")
        elif newest is None or newest["state"] != "rolling" or newest["dis"]["failed"]:
            soak.violate("rollout-finishes", f"{region}: newest rollout {newest} ({status.stderr[-300:]})")
        else:
            # One check per region: every active DI ends on the new image, through a slot or
            # through a pass that rendered it anew (see the count of DIs rolled in the report).
            soak.checked("rollout-finishes")
            with soak.lock:
                soak.counts[f"fleet rollout in {region}: DIs rolled"] = newest["dis"]["done"]


# ---------------------------------------------------------------------- the end checks

def converge(soak, watcher):
    """Every DI not deleted reaches its newest accepted spec (active, nothing pending) or error
    with a reason; every deleted one reaches 404."""
    deadline = now() + soak.args.settle
    pending = {d["id"]: d for d in soak.dis.values()}
    while pending and now() < deadline:
        for di_id, di in list(pending.items()):
            resp = soak.request(watcher.api(di), "GET", f"/v2/dedicated-inferences/{di_id}", what="settle")
            if resp is None:
                continue
            if di["deleted"]:
                if resp.status_code == 404:
                    soak.checked("converges")
                    del pending[di_id]
                continue
            if resp.status_code != 200:
                continue
            d = resp.json()["dedicated_inference"]
            if d["status"] == "error":
                ev = soak.request(watcher.api(di), "GET", f"/v2/dedicated-inferences/{di_id}/events?per_page=200", what="settle")
                if ev is None or ev.status_code != 200:
                    continue
                events = ev.json()["events"]
                last_spec = max((i for i, e in enumerate(events) if e["reason"] == "SpecAccepted"), default=-1)
                failures = [e["reason"] for e in events[last_spec + 1:]
                            if e["phase"] == "error" and e["reason"] in FAILURE_REASONS]
                di["outcome"] = f"error ({failures[-1] if failures else '?'})"
                if not failures:
                    soak.violate("converges", f"{di_id} in error without a failure of its newest spec: "
                                 f"{[(e['phase'], e['reason']) for e in events[-5:]]}")
                else:
                    soak.checked("converges")
                del pending[di_id]
            elif d["status"] == "active" and d.get("pending_deployment_spec") is None:
                if d["spec"]["version"] != di["accepted_version"]:
                    soak.violate("converges", f"{di_id}: active on v{d['spec']['version']}, newest accepted v{di['accepted_version']}")
                else:
                    check_spec(soak, di, d)
                di["outcome"] = "active"
                del pending[di_id]
        time.sleep(1)
    for di_id, di in pending.items():
        soak.violate("converges", f"{di_id} (deleted={di['deleted']}) did not settle within {soak.args.settle}s: "
                     f"{json.dumps(watcher.seen.get(di_id, {}).get('status'))}; story: {soak.story(di_id)}")


def check_spec(soak, di, d):
    want = [(m["model_slug"], m["accelerators"][0]["accelerator_slug"], m["accelerators"][0]["scale"])
            for m in di["expected"]["model_deployments"]]
    got = [(m["model_slug"], m["accelerators"][0]["accelerator_slug"], m["accelerators"][0]["scale"])
           for m in d["spec"]["model_deployments"]]
    if want != got or d["name"] != di["expected"]["name"]:
        soak.violate("converges", f"{di['id']}: serves {d['name']} {got}, accepted {di['expected']['name']} {want}")
    else:
        soak.checked("converges")


def region_records(soak, region):
    secret = soak.secrets_env[f"SECRET_{region}"]
    out, after = {}, 0
    while True:
        r = httpx.get(f"{soak.args.regionals[region]}/internal/v1/changes", params={"after": after, "limit": 1000},
                      headers={"x-region-secret": secret}, timeout=30)
        r.raise_for_status()
        body = r.json()
        for rec in body["records"]:
            out[rec["id"]] = rec
        if not body["records"] or body["last_seq"] <= after:
            return out
        after = body["last_seq"]


def compare_views(soak, teams):
    """Central's view (each team's list) equals each region's records; no DI on one side only."""
    central = {}
    for team, token in teams:
        page = 1
        while True:
            r = httpx.get(f"{soak.api}/v2/dedicated-inferences", params={"per_page": 200, "page": page},
                          headers={"Authorization": f"Bearer {token}"}, timeout=30)
            r.raise_for_status()
            body = r.json()
            for d in body["dedicated_inferences"]:
                central[d["id"]] = d
                d["_token"] = token
            if "next" not in body["links"]["pages"]:
                break
            page += 1
    region = {}
    for name in REGIONS:
        for rid, rec in region_records(soak, name).items():
            if not rec.get("gone"):
                region[rid] = rec
    for rid in region.keys() - central.keys():
        soak.violate("no-one-sided-di", f"{rid} exists in region {region[rid]['region']} but not in central's list")
    for cid in central.keys() - region.keys():
        soak.violate("no-one-sided-di", f"{cid} is in central's list but not in its region")
    for did in central.keys() & region.keys():
        c, r = central[did], region[did]
        cv = (c.get("pending_deployment_spec") or c.get("spec") or {}).get("version")
        rv = (r.get("pending_spec") or r.get("spec") or {}).get("version")
        if c["status"] != r["status"] or cv != rv:
            soak.violate("central-equals-region", f"{did}: central {c['status']} v{cv}, region {r['status']} v{rv}")
        else:
            soak.checked("central-equals-region")
    soak.checked("no-one-sided-di", len(central.keys() & region.keys()))
    known = set(soak.dis)
    for did in central.keys() - known:
        soak.violate("one-effect-per-2xx", f"{did} exists though no customer got a 202 for it")
        # Torn down with the rest, so that what it leaves behind is judged like everything else.
        with soak.lock:
            soak.dis[did] = {"id": did, "region": central[did]["region"], "api_token": central[did]["_token"],
                             "deleted": False, "story": [], "tokens": {}}
    return len(central), len(region)


def teardown(soak, watcher):
    """Deletes every DI at once, as `terraform destroy` does, and waits for 404 each."""
    threads = []
    for di in soak.dis.values():
        if not di["deleted"]:
            di["deleted"] = True
            t = threading.Thread(target=delete_di, args=(soak, watcher.api(di), di), daemon=True)
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    deadline = now() + soak.args.settle
    left = [d for d in soak.dis.values()]
    while left and now() < deadline:
        left = [d for d in left if (r := soak.request(watcher.api(d), "GET", f"/v2/dedicated-inferences/{d['id']}", what="teardown")) is None
                or r.status_code != 404]
        time.sleep(1)
    for d in left:
        soak.violate("nothing-left", f"{d['id']} not gone {soak.args.settle}s after its delete")
    soak.checked("nothing-left", len(soak.dis) - len(left))


def leftovers(soak):
    out = []
    for region in REGIONS:
        deadline = now() + 60
        while True:
            inv = httpx.get(f"{soak.sim(region)}/_sim/inventory", timeout=30).json()
            items = [f"cluster {c['name']}" for c in inv["cloud"]["clusters"]] + \
                    [f"node pool {p['name']}" for p in inv["cloud"]["node_pools"]] + \
                    [f"node {n['name']}" for n in inv["cloud"]["nodes"]] + \
                    [f"load balancer {lb['name']}" for lb in inv["cloud"]["load_balancers"]] + \
                    [f"endpoint {e['url']}" for e in inv["endpoints"]] + \
                    [f"namespace {o['metadata']['name']}" for objs in inv["kubernetes"].values() for o in objs
                     if o["kind"] == "Namespace" and o["metadata"]["name"].startswith("di-")]
            if not items or now() > deadline:
                break
            time.sleep(1)
        for item in items:
            soak.violate("nothing-left", f"{region}: {item}")
        if not items:
            soak.checked("nothing-left")
        out += items
    return out


def scan_logs(soak):
    logs = os.path.join(soak.state, "logs")
    lines = 0
    found = 0
    secrets = [s for s in soak.secrets if len(s) >= 12]
    for name in sorted(os.listdir(logs)):
        with open(os.path.join(logs, name), errors="replace") as f:
            for number, line in enumerate(f, 1):
                lines += 1
                for s in secrets:
                    if s in line:
                        found += 1
                        soak.violate("no-secret-in-logs", f"{name}:{number} holds a secret ({s[:6]}…)")
    if secrets:
        soak.checked("no-secret-in-logs", lines - found)
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--api", required=True)
    p.add_argument("--state", required=True, help="the run's state directory (secrets.env, run.pids, logs/)")
    p.add_argument("--bin", required=True, help="directory of the service binaries")
    p.add_argument("--central-db", required=True)
    p.add_argument("--hub", required=True, help="URL of the (simulated) Hugging Face Hub")
    p.add_argument("--sim", action="append", default=[], help="REGION=URL of a region simulator")
    p.add_argument("--regional", action="append", default=[], help="REGION=URL of a regional service")
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--teams", type=int, default=3)
    p.add_argument("--customers-per-team", type=int, default=2)
    p.add_argument("--dis-per-customer", type=int, default=2)
    p.add_argument("--settle", type=float, default=240, help="seconds allowed to converge, and to tear down")
    p.add_argument("--no-chaos", action="store_true")
    p.add_argument("--no-upgrade", action="store_true", help="no rolling upgrade of the workers mid-run")
    p.add_argument("--do-latency-ms", type=int, default=int(os.environ.get("REGION_SIM_DO_LATENCY_MS", "0")),
                   help="the DigitalOcean API's everyday latency, kept under every fault")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"the faults chaos draws from, comma-separated (a fault twice is drawn twice as often; "
                        f"default {','.join(FAULTS)})")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    args.faults = [f for f in args.faults.split(",") if f]
    if not args.faults or set(args.faults) - set(FAULTS):
        p.error(f"--faults: each of {sorted(set(FAULTS))}")
    args.sims = dict(s.split("=", 1) for s in args.sim)
    args.regionals = dict(s.split("=", 1) for s in args.regional)

    soak = Soak(args)
    for repo in FINE_TUNES:
        # A Llama 3.1 8B fine-tune: it fits every GPU the soak uses.
        httpx.post(f"{args.hub}/_sim/models", json={
            "id": repo, "architecture": "LlamaForCausalLM", "params": 8030261248, "layers": 32,
            "hidden": 4096, "heads": 32, "kv_heads": 8, "max_position_embeddings": 131072}, timeout=10).raise_for_status()
    print(f"soak: seed {args.seed}, {args.seconds:.0f} s, {args.teams} teams × {args.customers_per_team} customers", flush=True)
    teams, customers = [], []
    for t in range(args.teams):
        team, token = soak.mint_team()
        teams.append((team, token))
        vpcs = {r: [soak.make_vpc(team, r, f"soak-{t}-{r}-{i}") for i in range(2)] for r in REGIONS}
        for c in range(args.customers_per_team):
            customers.append(Customer(soak, team, token, vpcs, t * args.customers_per_team + c))
        if t == 0:
            customers.append(Customer(soak, team, token, vpcs, args.teams * args.customers_per_team, steady=True))
    soak.customers = customers
    watcher = Watcher(soak)
    chaos = Chaos(soak)
    for c in customers:
        c.start()
    watcher.start()
    if not args.no_chaos:
        chaos.start()
    upgrade = Upgrade(soak, chaos, next(c for c in customers if c.steady))
    if not args.no_upgrade:
        upgrade.start()
    soak.stop.wait(args.seconds)
    soak.stop.set()
    print("soak: stopping the customers and the chaos", flush=True)
    for c in customers:
        c.join(timeout=180)
    chaos.join(timeout=60)
    upgrade.join(timeout=120)
    chaos.heal()
    watcher.join(timeout=60)

    print("soak: waiting for every DI to settle", flush=True)
    converge(soak, watcher)
    if upgrade.done:
        rollout_finished(soak, upgrade)
    n_central, n_region = compare_views(soak, teams)
    print("soak: deleting everything at once", flush=True)
    teardown(soak, watcher)
    left = leftovers(soak)
    log_lines = scan_logs(soak)

    # The report.
    elapsed = now() - soak.started
    by_invariant = collections.Counter(v[1] for v in soak.violations)
    invariants = ["converges", "rollout-finishes", "lifecycle", "bad-input-refused", "one-effect-per-2xx", "retries-find-their-create", "keys-finish", "no-one-sided-di",
                  "central-equals-region", "revocation-within-5s", "serving-through-updates",
                  "made-up-tokens-refused", "valid-tokens-accepted",
                  "no-unexpected-5xx", "no-unexpected-4xx", "no-secret-in-logs", "nothing-left", "soak-driver"]
    outcomes = collections.Counter(d.get("outcome", "deleted" if d["deleted"] else "?") for d in soak.dis.values())
    print()
    print(f"=== soak report: seed {args.seed}, {elapsed:.0f} s in all ({args.seconds:.0f} s of load) ===")
    print(f"DIs created: {len(soak.dis)}; at the end before teardown: central {n_central}, regions {n_region}; outcomes {dict(outcomes)}")
    print("requests:")
    for k, v in sorted(soak.counts.items()):
        print(f"  {k:48} {v}")
    print("faults injected: " + (", ".join(f"{k} {v}" for k, v in sorted(soak.faults.items())) or "none"))
    print(f"log lines scanned for {len(soak.secrets)} secrets: {log_lines}; leftovers after teardown: {len(left)}")
    # Every invariant must have been checked: one never exercised would pass by accident. A
    # flood's refusals are required once chaos sent a flood; the soak driver's own crashes are
    # not a check.
    required = [inv for inv in invariants if inv != "soak-driver"
                and (inv != "made-up-tokens-refused" or soak.faults["token-flood"])
                and (inv != "rollout-finishes" or not args.no_upgrade)]
    unexercised = [inv for inv in required if soak.checks[inv] == 0]
    print("invariants (checks):")
    for inv in invariants:
        n = by_invariant.get(inv, 0)
        verdict = "FAIL" if n else ("NONE" if inv in unexercised else "ok  ")
        detail = f"{n} violations" if n else ("never checked" if inv in unexercised else "")
        print(f"  {verdict} {inv:28} {soak.checks[inv]:>8}" + (f"  ({detail})" if detail else ""))
    print(f"fault sequence: {chaos.fingerprint()} ({len(chaos.sequence)} faults)")
    if unexercised:
        print(f"never checked, so the run proves nothing about them: {', '.join(unexercised)}")
    if soak.violations or unexercised:
        print("violations (first 30):")
        for t, inv, detail in soak.violations[:30]:
            print(f"  [{t:7.1f}s] {inv}: {detail}")
        sys.exit(1)
    print("no violations")


if __name__ == "__main__":
    main()
