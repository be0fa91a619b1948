"""The scale benchmark's report (``bench.scale``): the tables and plots of a result, and the
ceiling projected from its per-call costs to a large run (docs/scale.md)."""

from __future__ import annotations

import itertools
from typing import Any

from bench.common import Table
from bench.scale_meter import KINDS
from bench.scale_spec import N

# -- tables, plots ----------------------------------------------------------------------------


def tables(result: dict[str, Any]) -> list[Table]:
    steps = result["steps"]
    spec = result["spec"]
    rows: list[list[Any]] = []
    backlog_rows: list[list[Any]] = []
    for s in steps:
        acc = s["accounting"]
        s["command_us_per_group"] = sum(k["usec"] for k in s["slowlog"]["kinds"].values()) / s["slowlog"]["groups"]
        rows.append([
            s["producers"], s["hosts"], s["variant"], s["groups_per_s"], s["ideal_groups_per_s"],
            s["redis_cpu_us_per_group"], s["command_us_per_group"], s["redis_cpu_share"], s["used_memory_mb"],
            s["clients"], f"{s['take_wall_p50_ms']:.0f} / {s['take_wall_p99_ms']:.0f}",
            f"{s['take_lag_p50_ms']:.1f} / {s['take_lag_p99_ms']:.1f}",
            f"{s['spread_min']}-{s['spread_max']} ({s['starved']} starved)", s["inspect_ms"],
            (f"{s['kill']['reclaim_s']:.1f} ({s['kill']['killed']} killed, {s['kill']['held_at_kill']} held)"
             if s["kill"]["held_at_kill"] else f"not measured: the {s['kill']['killed']} killed held nothing"),
            f"{acc['lost']} / {acc['doubled']}", f"{s['producer_cpu_mean']:.3f} / {s['producer_cpu_max']:.3f}",
            s["host_idle"],
        ])
        if "full_backlog" in s:
            fb = s["full_backlog"]
            backlog_rows.append([s["producers"], s["variant"], fb["admit_per_producer_s"],
                                 fb["admit_per_producer_s"] * s["producers"], fb["admit_us_per_call"],
                                 fb["redis_cpu_share"], s["redis_cpu_share"]])
    main = Table(
        "scale",
        f"Scale: producer processes on network-namespace hosts against one Redis {result.get('redis_version', '')}",
        ["producers", "hosts", "code", "groups/s", "latency-bound ideal", "Redis CPU us/group",
         "command us/group", "Redis cores", "Redis MB", "clients", "take() wall p50/p99 ms",
         "publish->take p50/p99 ms", "groups per producer min-max", "inspect ms",
         f"reclaim s after SIGKILL (lease {spec['lease']:.0f} s)", "lost / doubled", "producer CPU mean/max (cores)",
         "host idle"],
        rows,
        [
            f"Each producer: concurrency {spec['concurrency']} samples = {spec['concurrency'] // N} groups of {N}, "
            f"engine {spec['latency']:.0f} s per request ({spec['tokens']} tokens, sigma 0, one simulator per host); "
            f"batch = one round of every producer's groups; max_staleness {spec['max_staleness']}, weight "
            "version standing still; heartbeat 2 s; lease as shown (renew every third, reclaim check every quarter).",
            "Redis CPU us/group: Redis process CPU (user + sys) in the measured window / groups committed in it "
            "(networking included); command us/group: the time of the commands themselves (the clients' "
            "commands, scripts whole), from the slowlog window below.",
            "take() wall includes waiting for the engines (latency-bound); publish->take: time from the XADD of the "
            "batch's newest group (its entry id) to take() returning.",
            "producer CPU: CPU-seconds per wall-second of each producer process (1.0 = a core); host idle: share "
            "of the machine's CPU time idle in the window (the machine is shared with other work).",
        ],
        "python -m bench scale",
    )
    kinds_rows = []
    for s in steps:
        sl = s["slowlog"]
        per = {k: v["usec"] / sl["groups"] for k, v in sl["kinds"].items()}
        calls = {k: v["calls"] / sl["groups"] for k, v in sl["kinds"].items()}
        kinds_rows.append([s["producers"], s["variant"], sl["groups"], "yes" if sl["complete"] else "NO",
                           *(f"{per.get(k, 0):.1f} ({calls.get(k, 0):.2f})" for k in KINDS),
                           sum(per.values())])
    kinds = Table(
        "scale-commands",
        "Redis command time per group by kind: us (calls) per committed group, from a slowlog window",
        ["producers", "code", "groups", "complete", *KINDS, "total us"],
        kinds_rows,
        ["slowlog-log-slower-than 0 during the window: every command with its duration and client; EVALSHA "
         "attributed to its script by sha (ADMIT, PUBLISH, RENEW, ACK_DELETE = commit, SET_VERSION = version); "
         "commands run inside a script are counted in their EVALSHA. Slowlog adds its own cost to each command."],
        "python -m bench scale",
    )
    size_rows = []
    for z in result.get("sizes", []):
        size_rows.append([f"{z['n']} x {z['tokens']}", z["wire_bytes"] / 1e6, z["memory_bytes"] / 1e6,
                          z["publish"]["command_us"], z["publish"]["cpu_us"], z["take"]["command_us"],
                          z["take"]["cpu_us"], z["commit"]["command_us"], z["commit"]["cpu_us"]])
    by_size = Table(
        "scale-sizes",
        "Redis cost of one group by size, each operation alone on an idle Redis",
        ["group", "MB on the wire", "Redis MB held", "PUBLISH command us", "PUBLISH Redis CPU us",
         "read command us", "read Redis CPU us", "commit command us", "commit Redis CPU us"],
        size_rows,
        ["Redis CPU us: process CPU per group (parsing the request, the command, writing the reply)."],
        "python -m bench scale",
    )
    admit_rows = []
    for row in result.get("admit", []):
        before, after = row["before"], row["this code"]
        admit_rows.append([row["consumers"], before["command_us"], after["command_us"], before["cpu_us"],
                           after["cpu_us"], before["cpu_us"] / max(1e-9, after["cpu_us"])])
    admit = Table(
        "scale-admit",
        "ADMIT against the producers in the consumer group: before (XPENDING summary) / this code (XINFO GROUPS)",
        ["producers (consumers)", "command us before", "command us now", "Redis CPU us before", "Redis CPU us now",
         "x"],
        admit_rows,
        ["Each producer holds one prompt (a run's shape); one prompt admitted per call, 100 calls each, both "
         "scripts side by side on the same Redis."],
        "python -m bench scale",
    )
    check_rows = [[r["pending"], r["command_us"], r["cpu_us"]] for r in result.get("reclaim_check", [])]
    check = Table(
        "scale-reclaim-check",
        "One reclaim check (XPENDING IDLE lease COUNT 1, nothing idle) against the prompts in flight",
        ["prompts pending", "command us", "Redis CPU us"],
        check_rows,
        ["Every producer runs it for both prompt streams every min(5 s, lease / 4)."],
        "python -m bench scale",
    )
    backlog = Table(
        "scale-backlog",
        "The trainer holding off, the ready backlog full: what the refused producers cost Redis",
        ["producers", "code", "ADMIT calls per producer per s", "ADMIT calls per s", "us per ADMIT (slowlog)",
         "Redis cores, backlog full", "Redis cores, flowing (main table)"],
        backlog_rows,
        ["A refused producer retries ADMIT after its nap (this code: 2 s, or at once when a take() announces "
         "`taken`; before: every 0.2 s)."],
        "python -m bench scale",
    )
    tables = [main, kinds, by_size, admit, check, backlog]
    if steps and result.get("sizes") and result.get("admit") and result.get("reclaim_check"):
        tables.append(ceiling(result))
    return tables


# -- the ceiling, projected --------------------------------------------------------------------

LARGE_RUN = {"engines": 1024, "prompts_per_step": 512, "n": 16, "step_s": 60.0, "max_staleness": 1}
"""The large run the ceiling is compared with: 1,024 engines, 512 prompts x 16 samples a step, a step a minute."""
PRODUCTION = {"heartbeat_s": 2.0, "lease_s": 120.0, "reclaim_s": 5.0, "concurrency": 256}
"""A producer's defaults in such a run (heartbeat 2 s, lease 120 s: renew every 40 s, reclaim turn every 5 s)."""
NIC_BYTES_PER_S = 1.25e9
"""10 Gbit/s."""


def _per_call(step: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """(Redis CPU us of one round trip beyond its command, Redis CPU us per call of each kind),
    from the largest step: the process CPU per group minus the commands' own time, spread over
    the round trips of a group."""
    sl = step["slowlog"]
    calls = sum(k["calls"] for k in sl["kinds"].values()) / sl["groups"]
    command = sum(k["usec"] for k in sl["kinds"].values()) / sl["groups"]
    overhead = max(0.0, (step["redis_cpu_us_per_group"] - command) / calls)
    return overhead, {k: overhead + v["usec"] / v["calls"] for k, v in sl["kinds"].items() if v["calls"]}


def _interpolate(rows: list[tuple[float, float]], x: float) -> float:
    rows = sorted(rows)
    if len(rows) == 1 or x <= rows[0][0]:  # proportional below the first measured point
        return rows[0][1] * x / rows[0][0] if rows[0][0] else rows[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(rows):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = rows[-2], rows[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def projection(result: dict[str, Any]) -> dict[str, Any]:
    """The arithmetic of docs/scale.md's ceiling, from one result: per-producer costs per second
    at production defaults, per-group costs by size, groups/s one Redis core carries."""
    step = max((s for s in result["steps"] if s["variant"] == "this code"), key=lambda s: s["producers"])
    overhead, per_call = _per_call(step)
    in_flight = PRODUCTION["concurrency"] // LARGE_RUN["n"]
    sl = step["slowlog"]
    renew = sl["kinds"].get("renew", {"calls": 0, "usec": 0})
    ids_per_renew = result["spec"]["concurrency"] // N
    renew_us_per_id = (renew["usec"] / renew["calls"] / ids_per_renew) if renew["calls"] else 0.0
    scan = [(r["pending"], r["cpu_us"]) for r in result["reclaim_check"]]
    admit_now = [(r["consumers"], r["this code"]["cpu_us"]) for r in result["admit"]]
    admit_before = [(r["consumers"], r["before"]["cpu_us"]) for r in result["admit"]]
    refused = [s["full_backlog"]["admit_us_per_call"] for s in result["steps"] if s.get("full_backlog", {}).get(
        "admit_us_per_call")]
    refused_us = overhead + (sum(refused) / len(refused) if refused else per_call.get("admit", overhead) - overhead)
    out: dict[str, Any] = {"overhead_us": overhead, "per_call_us": per_call, "producers": {}, "sizes": [],
                           "refused_admit_us": refused_us}
    for producers in (128, 1024):
        outstanding = (LARGE_RUN["max_staleness"] + 1) * LARGE_RUN["prompts_per_step"]
        pel = min(producers * in_flight, outstanding)
        fixed = {
            "heartbeat": per_call.get("heartbeat", overhead) / PRODUCTION["heartbeat_s"],
            "renew": (overhead + renew_us_per_id * pel / producers) / (PRODUCTION["lease_s"] / 3),
            "reclaim turn": overhead / PRODUCTION["reclaim_s"],
        }
        fleet_scan = 2 * _interpolate(scan, pel) / PRODUCTION["reclaim_s"]
        before_scans = producers * (overhead + 2 * _interpolate(scan, pel)) / PRODUCTION["reclaim_s"]
        out["producers"][producers] = {
            "pending": pel, "fixed_us_per_s": fixed, "fixed_total_us_per_s": producers * sum(fixed.values()) + fleet_scan,
            "reclaim_scans_before_us_per_s": before_scans, "reclaim_scans_now_us_per_s": fleet_scan + producers * fixed[
                "reclaim turn"],
            "refused_admit_now_us_per_s": producers * _interpolate(admit_now, producers),
            "refused_admit_before_us_per_s": producers * _interpolate(admit_before, producers),
            "admit_now_us": _interpolate(admit_now, producers), "admit_before_us": _interpolate(admit_before, producers),
            "backlog_polls_before_us_per_s": producers / 0.2 * refused_us,
            "backlog_polls_now_us_per_s": producers * (1 / 2.0 + 1 / LARGE_RUN["step_s"]) * refused_us,
        }
    demand = LARGE_RUN["prompts_per_step"] / LARGE_RUN["step_s"]
    for z in result["sizes"]:
        per_group = {"publish": z["publish"]["cpu_us"], "take": z["take"]["cpu_us"], "commit": z["commit"]["cpu_us"]}
        row = {"n": z["n"], "tokens": z["tokens"], "wire_bytes": z["wire_bytes"], "memory_bytes": z["memory_bytes"],
               "per_group_us": per_group, "bw_groups_per_s": NIC_BYTES_PER_S / (2 * z["wire_bytes"]), "runs": {}}
        for producers, p in out["producers"].items():
            admit = p["admit_now_us"]
            g = sum(per_group.values()) + admit
            free = 1e6 - p["fixed_total_us_per_s"]
            row["runs"][producers] = {"us_per_group": g, "groups_per_s": free / g,
                                      "demand_share": (p["fixed_total_us_per_s"] + demand * g) / 1e6}
        out["sizes"].append(row)
    out["demand_groups_per_s"] = demand
    return out


def ceiling(result: dict[str, Any]) -> Table:
    proj = projection(result)
    rows = []
    for z in proj["sizes"]:
        for producers, r in z["runs"].items():
            p = proj["producers"][producers]
            rows.append([f"{z['n']} x {z['tokens']}", producers, r["us_per_group"], p["fixed_total_us_per_s"] / 1e3,
                         r["groups_per_s"], z["bw_groups_per_s"], z["memory_bytes"] / 1e6,
                         f"{100 * r['demand_share']:.1f} %"])
    demand = proj["demand_groups_per_s"]
    return Table(
        "scale-ceiling",
        f"Projected: what one Redis core carries (the large run: {LARGE_RUN['engines']:,} engines, "
        f"{LARGE_RUN['prompts_per_step']} prompts x {LARGE_RUN['n']} samples a step, a step a minute = "
        f"{demand:.2f} groups/s)",
        ["group", "producers", "Redis CPU us/group", "producers' fixed cost ms/s", "groups/s on one core",
         "groups/s on 10 Gbit/s", "Redis MB per group held", "the large run's share of one core"],
        rows,
        [f"Per round trip beyond its command: {proj['overhead_us']:.0f} us of Redis CPU (measured at the largest "
         "step); per group: PUBLISH + read + commit of that size (measured alone) + one ADMIT with that many "
         "producers; fixed: heartbeats, lease renewals, reclaim turns at production defaults "
         f"({PRODUCTION}).",
         "docs/scale.md walks through the arithmetic."],
        "python -m bench.scale render",
    )


def plot(result: dict[str, Any]) -> None:
    from bench.common import IMG, plt

    steps = [s for s in result["steps"] if s["variant"] == "this code"]
    if not steps:
        return
    pyplot = plt()
    ps = [s["producers"] for s in steps]
    fig, ax = pyplot.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(ps, [s["groups_per_s"] for s in steps], marker="o", label="measured")
    ax[0].plot(ps, [s["ideal_groups_per_s"] for s in steps], linestyle="--", label="latency-bound ideal")
    ax[0].set_ylabel("groups/s")
    ax[1].plot(ps, [s["redis_cpu_us_per_group"] for s in steps], marker="o", label="Redis process CPU")
    ax[1].plot(ps, [sum(k["usec"] for k in s["slowlog"]["kinds"].values()) / s["slowlog"]["groups"] for s in steps],
               marker="s", label="the commands themselves (slowlog)")
    ax[1].set_ylabel("Redis CPU us per group")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xticks(ps, [str(p) for p in ps])
        a.set_xlabel("producer processes")
        a.legend()
    fig.suptitle("scale: producers on network-namespace hosts, one Redis (python -m bench scale)")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "scale.png", dpi=100)
    pyplot.close(fig)
    fig, axis = pyplot.subplots(figsize=(6, 4))
    axis.plot(ps, [s["take_wall_p99_ms"] for s in steps], marker="o", label="take() wall p99")
    axis.plot(ps, [s["take_lag_p99_ms"] for s in steps], marker="s", label="publish -> take p99")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(ps, [str(p) for p in ps])
    axis.set_xlabel("producer processes")
    axis.set_ylabel("ms")
    axis.legend()
    axis.set_title("take() p99 vs producers")
    fig.tight_layout()
    fig.savefig(IMG / "scale-take.png", dpi=100)
    pyplot.close(fig)
