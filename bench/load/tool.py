"""bench/run's helpers, standard library only.

  tool.py wait URL SECONDS                 wait until URL answers 200
  tool.py seed BASE TOKEN COUNT PREFIX     create COUNT DIs through central; print the first id
  tool.py cpu-snapshot FILE NAME=PID[,PID]...
                                           record CPU ticks used so far by each named group
                                           (and their reaped children) and by the whole machine
  tool.py cpu-report BEFORE AFTER          print the cores each group kept busy in between
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request

REGIONS = ["atl1", "nyc2", "tor1"]


def wait(url, seconds):
    deadline = time.monotonic() + float(seconds)
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{url} did not answer within {seconds} s")
        time.sleep(0.1)


def seed(base, token, count, prefix):
    first = None
    for i in range(int(count)):
        body = {
            "spec": {
                "version": 1,
                "name": f"{prefix}-seed-{i}",
                "region": REGIONS[i % len(REGIONS)],
                "vpc": None,  # the team's default VPC
                "enable_public_endpoint": True,
                "model_deployments": [
                    {
                        "model_slug": "qwen/qwen2.5-7b-instruct",
                        "model_provider": "hugging_face",
                        "workload_config": {},
                        "accelerators": [
                            {"scale": 1, "type": "prefill_decode", "accelerator_slug": "gpu-h100x1-80gb"}
                        ],
                    }
                ],
            }
        }
        request = urllib.request.Request(
            base + "/v2/dedicated-inferences",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                if response.status != 202:
                    sys.exit(f"create answered {response.status}")
                created = json.load(response)
        except urllib.error.HTTPError as e:
            sys.exit(f"create answered {e.code}: {e.read().decode(errors='replace')}")
        if first is None:
            first = created["dedicated_inference"]["id"]
    # Check that a GET of the first one works before measuring it.
    request = urllib.request.Request(
        f"{base}/v2/dedicated-inferences/{first}",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.load(response)["dedicated_inference"]["id"] == first
    print(first)


def ticks(pid):
    """(own utime+stime, reaped children's cutime+cstime) of a process, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    # fields[0] is field 3 (state): utime is field 14, stime 15, cutime 16, cstime 17.
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def children():
    """pid -> list of child pids, for every process."""
    tree = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def group_ticks(roots, tree):
    total = 0
    stack = list(roots)
    while stack:
        pid = stack.pop()
        own, reaped = ticks(pid)
        total += own + reaped
        stack.extend(tree.get(pid, []))
    return total


def machine_ticks():
    """CPU ticks the machine spent busy, steal excluded (see `steal_ticks`)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:7]) - idle


def steal_ticks():
    """CPU ticks the hypervisor gave to other guests while this one wanted them. On a shared
    virtual machine this is time no process here could use; it is reported apart from "other"."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return values[7] if len(values) > 7 else 0


def cpu_snapshot(path, groups):
    tree = children()
    snapshot = {
        "time": time.monotonic(),
        "machine": machine_ticks(),
        "steal": steal_ticks(),
        "groups": {},
    }
    for group in groups:
        name, pids = group.split("=", 1)
        snapshot["groups"][name] = group_ticks([int(p) for p in pids.split(",") if p], tree)
    with open(path, "w") as f:
        json.dump(snapshot, f)


def cpu_report(before_path, after_path):
    with open(before_path) as f:
        before = json.load(f)
    with open(after_path) as f:
        after = json.load(f)
    hz = os.sysconf("SC_CLK_TCK")
    seconds = after["time"] - before["time"]
    cores = lambda t: t / hz / seconds
    parts = []
    accounted = 0
    for name, value in after["groups"].items():
        used = value - before["groups"].get(name, 0)
        accounted += used
        parts.append(f"{name} {cores(used):.2f}")
    machine = after["machine"] - before["machine"]
    parts.append(f"other (load generator) {cores(max(machine - accounted, 0)):.2f}")
    steal = after.get("steal", 0) - before.get("steal", 0)
    print(
        f"cores busy: {', '.join(parts)}; machine {cores(machine):.2f} of {os.cpu_count()}, "
        f"{cores(steal):.2f} taken by the hypervisor (steal)"
    )
    if cores(steal) > 0.05 * (os.cpu_count() or 1):
        print("  warning: over 5 % steal; these figures are not comparable with a quiet run")


def main():
    command, args = sys.argv[1], sys.argv[2:]
    if command == "wait":
        wait(*args)
    elif command == "seed":
        seed(*args)
    elif command == "cpu-snapshot":
        cpu_snapshot(args[0], args[1:])
    elif command == "cpu-report":
        cpu_report(*args)
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main()
