#!/usr/bin/env python3
"""CPU time of a running process, per thread name, from /proc (no perf needed).

  thread_cpu.py snapshot PID > before.json     # cumulative user+system seconds per thread
  thread_cpu.py diff before.json after.json    # JSON: total and per-name seconds in between,
                                               # and the busiest thread of each name

Threads are grouped by name with trailing digits and separators stripped (grpc's
"default-executo" pool, our "attn-lane-0"/"attn-lane-1" -> "attn-lane"), so the diff says which
part of the server spent the CPU: gRPC's transport and callback threads, the batcher's lanes,
the lanes' copy helpers; "busiest" says whether one thread of a group was saturated (a
serialised bottleneck) rather than the group as a whole. Threads that exited between the
snapshots are not counted.
"""
import json
import os
import re
import sys

TICKS = os.sysconf("SC_CLK_TCK")


def snapshot(pid):
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread exited
        # comm is in parentheses and may hold spaces; the fields after it are space-separated.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        utime, stime = int(fields[11]), int(fields[12])
        threads[tid] = {"name": name, "seconds": (utime + stime) / TICKS}
    return threads


def group(name):
    return re.sub(r"[-_ ]*\d+$", "", name) or name


def diff(before, after):
    groups, busiest = {}, {}
    for tid, t in after.items():
        spent = t["seconds"] - before.get(tid, {"seconds": 0})["seconds"]
        name = group(t["name"])
        groups[name] = groups.get(name, 0) + spent
        busiest[name] = max(busiest.get(name, 0), spent)
    groups = {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v > 0}
    return {"total_s": round(sum(groups.values()), 3), "threads": groups,
            "busiest": {k: round(busiest[k], 3) for k in groups}}


def main(argv):
    if len(argv) == 3 and argv[1] == "snapshot":
        json.dump(snapshot(int(argv[2])), sys.stdout)
    elif len(argv) == 4 and argv[1] == "diff":
        with open(argv[2]) as b, open(argv[3]) as a:
            json.dump(diff(json.load(b), json.load(a)), sys.stdout)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
