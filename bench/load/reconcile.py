"""bench/reconcile's helpers, standard library only.

  reconcile.py creates BASE TOKEN START COUNT PREFIX POLL_MS TIMEOUT_S OUT REGION=VPC[,VPC]...
        fires COUNT `POST /v2/dedicated-inferences` at once (one connection each), DIs number
        START.. spread round-robin over the regions and, within a region, filling its VPCs
        evenly; then lists the DIs (`GET /v2/dedicated-inferences`, 200 a page) every POLL_MS
        until each is `active` with nothing pending; writes the figures to OUT (JSON) and prints
        a summary.
        Exits 1 when a create failed, a DI went to `error` or did not become active in TIMEOUT_S.
  reconcile.py sim-stats OUT NAME=URL...        saves every simulator's /_sim/stats
  reconcile.py metrics OUT NAME=URL...          saves every worker's /metrics (selected series)
  reconcile.py cpu OUT NAME=PID[,PID]...        CPU seconds used so far per group (and children)
  reconcile.py report-cpu CPU_BEFORE CPU_AFTER
  reconcile.py report-creates RESULT CPU_BEFORE CPU_AFTER METRICS_BEFORE METRICS_AFTER
  reconcile.py report-resync DIS WALL_S SIMS_BEFORE SIMS_AFTER CPU_BEFORE CPU_AFTER
        METRICS_BEFORE METRICS_AFTER OUTBOX_BEFORE OUTBOX_AFTER
"""

import asyncio
import datetime
import json
import os
import sys
import time
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool  # noqa: E402  (bench/run's helpers: process-tree CPU ticks)

MODEL = "qwen/qwen2.5-7b-instruct"
ACCELERATOR = "gpu-h100x1-80gb"


# --- a minimal HTTP/1.1 keep-alive client ---------------------------------------------------------


class Conn:
    def __init__(self, host, port, token):
        self.host, self.port, self.token = host, port, token
        self.reader = self.writer = None

    async def open(self):
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def request(self, method, path, body=None, headers=()):
        if self.writer is None:
            await self.open()
        lines = [
            f"{method} {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            f"Authorization: Bearer {self.token}",
            "Accept: application/json",
        ]
        lines.extend(headers)
        payload = b""
        if body is not None:
            payload = json.dumps(body).encode()
            lines.append("Content-Type: application/json")
            lines.append(f"Content-Length: {len(payload)}")
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("connection closed")
        status = int(status_line.split()[1])
        length, chunked, close = None, False, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "connection" and value == "close":
                close = True
        if chunked:
            data = b""
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    break
                data += await self.reader.readexactly(size)
                await self.reader.readline()
        elif length is not None:
            data = await self.reader.readexactly(length)
        else:
            data = await self.reader.read()
            close = True
        if close:
            self.close()
        return status, data


def percentile(values, p):
    """Nearest-rank percentile of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))  # ceil(n * p / 100)
    return ordered[int(rank) - 1]


# --- creates ---------------------------------------------------------------------------------------


def create_body(name, region, vpc):
    return {
        "spec": {
            "version": 1,
            "name": name,
            "region": region,
            "vpc": {"uuid": vpc},
            "enable_public_endpoint": True,
            "model_deployments": [
                {
                    "model_slug": MODEL,
                    "model_provider": "hugging_face",
                    "workload_config": {},
                    "accelerators": [
                        {"scale": 1, "type": "prefill_decode", "accelerator_slug": ACCELERATOR}
                    ],
                }
            ],
        }
    }


async def one_di(conn, i, prefix, region, vpc, start_gate, pending, result):
    """POST one DI once the gate opens; the poller then watches it until it is active."""
    body = create_body(f"{prefix}-{i}", region, vpc)
    key = f"Idempotency-Key: {uuid.uuid4()}"
    await start_gate.wait()
    sent = time.monotonic()
    result["sent"] = sent
    try:
        status, data = await conn.request("POST", "/v2/dedicated-inferences", body, [key])
    except Exception as e:  # noqa: BLE001 (any transport error is a failed create)
        result["error"] = f"create: {type(e).__name__}: {e}"
        return
    result["accepted"] = time.monotonic() - sent
    if status != 202:
        result["error"] = f"create answered {status}: {data[:300].decode(errors='replace')}"
        return
    di_id = json.loads(data)["dedicated_inference"]["id"]
    result["id"] = di_id
    pending[di_id] = result


def seen(result, di, now):
    """Records what one listing showed of a pending DI; True once it is done (active or error)."""
    result["status"] = di["status"]
    result["polls"] = result.get("polls", 0) + 1
    if di["status"] == "active" and di.get("pending_deployment_spec") is None:
        result["active"] = now - result["sent"]
        # As the control plane recorded it: created, then last updated (turned active).
        try:
            stamp = datetime.datetime.fromisoformat
            created = stamp(di["created_at"].replace("Z", "+00:00"))
            updated = stamp(di["updated_at"].replace("Z", "+00:00"))
            result["recorded"] = (updated - created).total_seconds()
        except (KeyError, ValueError, AttributeError):
            pass
        return True
    if di["status"] == "error":
        result["error"] = f"{di['id']}: error: {json.dumps(di.get('error') or di)[:300]}"
        return True
    return False


async def poll_until_active(conn, pending, creating, poll, deadline, first_page=1):
    """Lists the DIs (200 a page) every `poll` seconds, as a dashboard would, and marks each
    pending one active (or failed) at the first listing that shows it so. One listing serves every
    DI: a GET per DI this often would load the machine more than the system under test. The list
    is oldest first, so it starts at `first_page`, where the batch's DIs begin: listing the DIs
    made before it, every poll, would cost more with every batch while a region fills."""
    while creating() or pending:
        if time.monotonic() > deadline:
            for di_id, result in pending.items():
                result["error"] = f"{di_id}: not active within the timeout (last status {result.get('status')})"
            return
        page = first_page
        while pending:
            try:
                status, data = await conn.request(
                    "GET", f"/v2/dedicated-inferences?per_page=200&page={page}"
                )
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                conn.close()  # reconnects on the next request
                break
            if status != 200:
                if status not in (429, 503):
                    for di_id, result in pending.items():
                        result["error"] = f"list answered {status}: {data[:300].decode(errors='replace')}"
                    return
                break
            now = time.monotonic()
            listed = json.loads(data).get("dedicated_inferences") or []
            for di in listed:
                result = pending.get(di["id"])
                if result is not None and seen(result, di, now):
                    del pending[di["id"]]
            if len(listed) < 200:
                break
            page += 1
        await asyncio.sleep(poll)


def placement(i, vpcs):
    """(region, VPC) of the DI numbered i: regions round-robin, then the region's VPCs in turn."""
    regions = list(vpcs)
    region = regions[i % len(regions)]
    ids = vpcs[region]
    return region, ids[(i // len(regions)) % len(ids)]


async def run_creates(base, token, start, count, prefix, poll_ms, timeout_s, vpcs):
    host, port = base.split("//", 1)[1].rsplit(":", 1)
    conns = [Conn(host, int(port), token) for _ in range(count)]
    poller = Conn(host, int(port), token)
    # Connect first, so that the creates leave at (nearly) the same moment.
    await asyncio.gather(*(c.open() for c in conns + [poller]))
    gate = asyncio.Event()
    results = [{} for _ in range(count)]
    pending = {}
    tasks = [
        asyncio.create_task(
            one_di(conns[i], start + i, prefix, *placement(start + i, vpcs), gate, pending, results[i])
        )
        for i in range(count)
    ]
    await asyncio.sleep(0)
    started = time.monotonic()
    gate.set()
    watch = asyncio.create_task(
        poll_until_active(
            poller, pending, lambda: not all(t.done() for t in tasks),
            poll_ms / 1000.0, started + timeout_s, start // 200 + 1,
        )
    )
    await asyncio.gather(*tasks)
    await watch
    wall = time.monotonic() - started
    for c in conns + [poller]:
        c.close()
    return results, wall


def creates(base, token, start, count, prefix, poll_ms, timeout_s, out, *region_vpcs):
    vpcs = {}
    for rv in region_vpcs:
        region, ids = rv.split("=", 1)
        vpcs[region] = ids.split(",")
    start, count, poll_ms, timeout_s = int(start), int(count), float(poll_ms), float(timeout_s)
    results, wall = asyncio.run(
        run_creates(base, token, start, count, prefix, poll_ms, timeout_s, vpcs)
    )
    errors = [r["error"] for r in results if "error" in r]
    active = [r["active"] for r in results if "active" in r]
    accepted = [r["accepted"] for r in results if "accepted" in r]
    polls = sum(r.get("polls", 0) for r in results)
    # How often each DI was really looked at: from the 202 to active, over the listings it was in.
    gaps = [
        (r["active"] - r["accepted"]) / r["polls"]
        for r in results
        if "active" in r and r.get("polls")
    ]
    summary = {
        "count": count,
        "active": len(active),
        "errors": errors,
        "wall_s": wall,
        "poll_ms": poll_ms,
        "polls": polls,
        "mean_poll_gap_s": sum(gaps) / len(gaps) if gaps else 0,
        "ids": [r["id"] for r in results if "id" in r],
        "time_to_active_s": active,
        "recorded_s": [r["recorded"] for r in results if "recorded" in r],
        "accepted_s": accepted,
    }
    with open(out, "w") as f:
        json.dump(summary, f)
    for e in errors[:10]:
        print(f"error: {e}", file=sys.stderr)
    if len(errors) > 10:
        print(f"error: … and {len(errors) - 10} more", file=sys.stderr)
    print(f"{len(active)}/{count} active in {wall:.2f} s", file=sys.stderr)
    sys.exit(1 if errors or len(active) != count else 0)


# --- snapshots -------------------------------------------------------------------------------------


def fetch(url, timeout=60):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def sim_stats(out, *named_urls):
    snap = {}
    for nu in named_urls:
        name, url = nu.split("=", 1)
        snap[name] = json.loads(fetch(url.rstrip("/") + "/_sim/stats"))
    with open(out, "w") as f:
        json.dump(snap, f)


METRIC_PREFIXES = (
    "worker_reconcile_passes_total",
    "worker_reconcile_duration_seconds_sum",
    "digitalocean_api_requests_total",
    "kubernetes_api_requests_total",
)


def metrics(out, *named_urls):
    """Sums of the selected counters over every worker, by series (labels kept)."""
    series = {}
    for nu in named_urls:
        _, url = nu.split("=", 1)
        try:
            text = fetch(url.rstrip("/") + "/metrics", timeout=10)
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(METRIC_PREFIXES):
                key, _, value = line.rpartition(" ")
                try:
                    series[key] = series.get(key, 0.0) + float(value)
                except ValueError:
                    pass
    with open(out, "w") as f:
        json.dump(series, f)


def cpu(out, *groups):
    tree = tool.children()
    snap = {
        "time": time.monotonic(),
        "machine": tool.machine_ticks(),
        "steal": tool.steal_ticks(),
        "groups": {},
    }
    for group in groups:
        name, pids = group.split("=", 1)
        snap["groups"][name] = tool.group_ticks([int(p) for p in pids.split(",") if p], tree)
    with open(out, "w") as f:
        json.dump(snap, f)


def load(path):
    with open(path) as f:
        return json.load(f)


def cpu_lines(before_path, after_path):
    before, after = load(before_path), load(after_path)
    hz = os.sysconf("SC_CLK_TCK")
    seconds = after["time"] - before["time"]
    parts = []
    accounted = 0
    for name, value in after["groups"].items():
        used = value - before["groups"].get(name, 0)
        accounted += used
        parts.append(f"{name} {used / hz:.2f}")
    machine = after["machine"] - before["machine"]
    steal = after.get("steal", 0) - before.get("steal", 0)
    parts.append(f"other {max(machine - accounted, 0) / hz:.2f}")
    available = seconds * (os.cpu_count() or 1)
    line = (
        f"CPU seconds over {seconds:.1f} s: {', '.join(parts)}; "
        f"machine {machine / hz:.2f} of {available:.1f} available, "
        f"{steal / hz:.2f} taken by the hypervisor (steal)"
    )
    if available and steal / hz > 0.05 * available:
        line += "\n  warning: over 5 % steal; these figures are not comparable with a quiet run"
    return line


def cpu_per(before_path, after_path, count):
    """CPU milliseconds per item (a create of a batch) of every group and of the rest of the
    machine, on one line: where a batch's time went."""
    before, after = load(before_path), load(after_path)
    hz, count = os.sysconf("SC_CLK_TCK"), int(count)
    used = {n: (v - before["groups"].get(n, 0)) for n, v in after["groups"].items()}
    used["other"] = max(after["machine"] - before["machine"] - sum(used.values()), 0)
    print(", ".join(f"{n} {v / hz / count * 1000:.1f}" for n, v in used.items()))


def metric_delta(before_path, after_path):
    before, after = load(before_path), load(after_path)
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def label(series, name):
    marker = f'{name}="'
    if marker not in series:
        return "?"
    return series.split(marker, 1)[1].split('"', 1)[0]


def report_passes(delta, indent="  "):
    passes = {}
    for k, v in delta.items():
        if k.startswith("worker_reconcile_passes_total"):
            key = f"{label(k, 'phase')}/{label(k, 'outcome')}"
            passes[key] = passes.get(key, 0) + v
    total = sum(passes.values())
    seconds = sum(v for k, v in delta.items() if k.startswith("worker_reconcile_duration_seconds_sum"))
    detail = ", ".join(f"{k} {int(v)}" for k, v in sorted(passes.items()))
    line = f"{indent}worker reconcile passes: {int(total)}" + (f" ({detail})" if detail else "")
    if total and seconds:
        line += f"; {seconds / total * 1000:.0f} ms each on average"
    return total, line


def report_creates(result_path, cpu_before, cpu_after, metrics_before, metrics_after):
    r = load(result_path)
    ms = lambda s: f"{s * 1000:.0f} ms"  # noqa: E731
    active = r["time_to_active_s"]
    print(f"  creates: {r['count']} fired at once, {r['active']} active, {len(r['errors'])} failed")
    if r["accepted_s"]:
        acc = r["accepted_s"]
        print(
            f"  POST answered (202): p50 {ms(percentile(acc, 50))}, p99 {ms(percentile(acc, 99))}, "
            f"max {ms(max(acc))}"
        )
    if active:
        print(
            f"  time to active (POST sent -> first GET showing active, nothing pending): "
            f"p50 {ms(percentile(active, 50))}, p99 {ms(percentile(active, 99))}, max {ms(max(active))}"
        )
    recorded = r.get("recorded_s") or []
    if recorded:
        print(
            f"  as recorded (created_at -> updated_at when first seen active; no polling in it): "
            f"p50 {ms(percentile(recorded, 50))}, p99 {ms(percentile(recorded, 99))}, "
            f"max {ms(max(recorded))}"
        )
    print(f"  wall time (first POST -> last DI active): {r['wall_s']:.2f} s")
    achieved = r["polls"] / r["wall_s"] if r["wall_s"] else 0
    print(
        f"  polling: a listing of every DI each {r['poll_ms']:.0f} ms plus the listing's own time; "
        f"each pending DI was seen every {r['mean_poll_gap_s'] * 1000:.0f} ms on average "
        f"({r['polls']} sightings, {achieved:.0f}/s)"
    )
    total, line = report_passes(metric_delta(metrics_before, metrics_after))
    print(line + (f"; {total / r['count']:.1f} per DI" if r["count"] else ""))
    print("  " + cpu_lines(cpu_before, cpu_after))
    if active:
        p99 = percentile(active, 99)
        verdict = "met" if p99 <= 1.0 else "NOT met"
        print(f"  target: time-to-active p99 = {ms(p99)} (target <= 1000 ms): {verdict}")


def kinds_delta(before, after, api):
    b = before.get("requests", {}).get(api, {})
    a = after.get("requests", {}).get(api, {})
    return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0) > 0}


MUTATING = ("POST", "PUT", "PATCH", "DELETE")


def report_resync(dis, wall, sims_before, sims_after, cpu_before, cpu_after,
                  metrics_before, metrics_after, outbox_before, outbox_after):
    dis, wall = int(dis), float(wall)
    before, after = load(sims_before), load(sims_after)
    totals = {"do": [0, 0], "kube": [0, 0]}  # writes, reads
    by_kind = {"do": {}, "kube": {}}
    data_plane = 0
    for sim in after:
        for api in ("do", "kube"):
            for kind, n in kinds_delta(before[sim], after[sim], api).items():
                write = kind.split(" ", 1)[0] in MUTATING
                totals[api][0 if write else 1] += n
                by_kind[api][kind] = by_kind[api].get(kind, 0) + n
        data_plane += after[sim].get("data_plane_requests", 0) - before[sim].get("data_plane_requests", 0)
    writes = totals["do"][0] + totals["kube"][0]
    print(f"  DIs resynced: {dis}; wall time of the pass: {wall:.2f} s ({dis / wall:.0f} DIs/s)" if wall else "")
    print(f"  API writes (POST/PUT/PATCH/DELETE, counted at the simulator): {writes} "
          f"(DigitalOcean {totals['do'][0]}, Kubernetes {totals['kube'][0]})")
    print(f"  API reads: DigitalOcean {totals['do'][1]}, Kubernetes {totals['kube'][1]}; "
          f"data-plane requests (endpoint probes) {data_plane}")
    if dis:
        print(f"  per DI: {totals['do'][0] / dis:.2f} DO writes, {totals['kube'][0] / dis:.2f} Kubernetes writes, "
              f"{totals['do'][1] / dis:.2f} DO reads, {totals['kube'][1] / dis:.2f} Kubernetes reads")
    for api, title in (("do", "DigitalOcean"), ("kube", "Kubernetes")):
        kinds = by_kind[api]
        if not kinds:
            continue
        print(f"  {title} calls by kind (writes first):")
        ordered = sorted(kinds.items(), key=lambda kv: (kv[0].split(" ", 1)[0] not in MUTATING, -kv[1], kv[0]))
        for kind, n in ordered:
            mark = "WRITE" if kind.split(" ", 1)[0] in MUTATING else "read "
            print(f"    {mark} {n:7d}  {kind}")
    delta = metric_delta(metrics_before, metrics_after)
    _, line = report_passes(delta)
    print(line)
    print(f"  outbox entries written (status/event changes) during the pass: "
          f"{int(outbox_after) - int(outbox_before)}")
    print("  " + cpu_lines(cpu_before, cpu_after))
    if dis:
        b, a = load(cpu_before), load(cpu_after)
        hz = os.sysconf("SC_CLK_TCK")
        per = {n: (a["groups"][n] - b["groups"].get(n, 0)) / hz / dis * 1000 for n in a["groups"]}
        print("  CPU per DI: " + ", ".join(f"{n} {v:.2f} ms" for n, v in per.items()))
    print(f"  target: API writes = {writes} (target 0): {'met' if writes == 0 else 'NOT met'}")


def main():
    command, args = sys.argv[1], sys.argv[2:]
    commands = {
        "creates": creates,
        "sim-stats": sim_stats,
        "metrics": metrics,
        "cpu": cpu,
        "report-creates": report_creates,
        "report-resync": report_resync,
        "report-cpu": lambda before, after: print(cpu_lines(before, after)),
        "cpu-per": cpu_per,
    }
    if command not in commands:
        sys.exit(f"unknown command {command}")
    commands[command](*args)


if __name__ == "__main__":
    main()
