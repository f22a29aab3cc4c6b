#!/usr/bin/env python3
"""An RL-style loop that resets N sandboxes (8 by default) to one checkpoint each episode.

Once: create a sandbox, warm it up (a Python REPL loads its "environment": a big table
in memory, a file on disk), checkpoint it ("warm"), and fork N sandboxes from that warm
checkpoint, then prewarm N standbys of it (restored, frozen copies: a reset that takes
one is a thaw). Then, each episode, in all N sandboxes in parallel: take a few steps (send
actions to the REPL, read rewards back, touch files), then roll each sandbox back to the
warm checkpoint — memory, processes and files — instead of rebuilding it. The first
observation of every episode shows the reset worked (step counter 0, no leftover file).

Run against a running cairnd (CAIRN_URL / CAIRN_TOKEN, or the default socket):

    python3 examples/rl_reset.py --envs 8 --episodes 3 --steps 4
"""

import argparse
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cairn import Client, FailedPrecondition  # noqa: E402

WARMUP = """
import os, random
table = [i * i for i in range(10**6)]   # expensive state worth keeping warm
steps = 0
total = 0
os.makedirs('/env', exist_ok=True)
_ = open('/env/ready', 'w').write('1')
print('WARM', len(table))
"""

STEP = ("steps += 1; total += table[{a}] % 7; _ = open('/env/step-%d' % steps, 'w').write(str(total)); "
        "print('OBS', steps, total, len(os.listdir('/env')))\n")


def step(proc, action):
    """Send one action; return (steps, total, files in /env) as the environment reports it."""
    proc.send(STEP.format(a=action))
    line = proc.read_until("\n", timeout=60)
    while "OBS" not in line:  # a fork's copy of the REPL first shows the warm-up's output
        line = proc.read_until("\n", timeout=60)
    s, t, n = line.split("OBS", 1)[1].split()[:3]
    return int(s), int(t), int(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--template", default="debian")
    ap.add_argument("--isolation", default=os.environ.get("CAIRN_ISOLATION") or None)
    args = ap.parse_args()

    c = Client()
    base = c.create(template=args.template, isolation=args.isolation, ttl=1800, labels={"example": "rl_reset"})
    print("created base sandbox %s (%s)" % (base.id, base.isolation))
    envs = []
    try:
        repl = base.spawn(["python3", "-i", "-u"])
        repl.send(WARMUP)
        print("warm-up:", repl.read_until("WARM", timeout=120).strip(), repl.read_until("\n").strip())
        warm = base.checkpoint(label="warm")
        print("warm checkpoint %s (%.1f MB of process images, %.0f ms)"
              % (warm.id, warm.image_bytes / 1e6, warm.duration_ms))
        t = time.monotonic()
        envs = warm.fork(count=args.envs, labels={"role": "env"})
        print("forked %d envs from %s in %.2f s: %s" % (len(envs), warm.id, time.monotonic() - t,
                                                         " ".join(e.id for e in envs)))
        procs = [e.process(repl.handle) for e in envs]  # each fork's copy of the REPL
        # One standby per env: the first reset of every env is then a thaw (milliseconds)
        # rather than a restore; each taken standby is replaced in the background for the
        # next episode. It costs a restore per standby now and their memory while held.
        t = time.monotonic()
        try:
            ready = warm.prewarm(count=args.envs)
        except FailedPrecondition:  # gvisor has no standbys: resets restore
            ready = 0
        print("prewarmed %s: %d standbys ready in %.2f s%s" % (warm.id, ready, time.monotonic() - t,
                                                             "" if ready else " (none on this isolation backend)"))

        def episode(i, ep):
            rng = random.Random(ep * 1000 + i)
            obs = []
            for _ in range(args.steps):
                obs.append(step(procs[i], rng.randrange(10**6)))
            first = obs[0]
            if first[0] != 1 or first[2] != 2:  # steps counter and /env files reset?
                raise AssertionError("env %s did not start episode %d from the warm state: %s" % (envs[i].id, ep, first))
            t = time.monotonic()
            envs[i].rollback(warm)  # reset: memory, processes and files back to warm
            return obs[-1][1], time.monotonic() - t

        with ThreadPoolExecutor(max_workers=args.envs) as pool:
            for ep in range(args.episodes):
                t = time.monotonic()
                res = list(pool.map(lambda i: episode(i, ep), range(len(envs))))
                returns = [r for r, _ in res]
                print("episode %d: %d envs x %d steps, returns %s; reset %d envs to %s (max %.2f s); %.1f s"
                      % (ep, len(envs), args.steps, returns, len(envs), warm.id, max(d for _, d in res),
                         time.monotonic() - t))
        print("RESULT %d episodes x %d envs, every episode started from the warm state" % (args.episodes, len(envs)))
    finally:
        for e in envs + [base]:
            try:
                e.destroy()
            except Exception as err:  # keep cleaning up
                print("destroy %s: %s" % (e.id, err))
        print("destroyed %d sandboxes" % (len(envs) + 1))


if __name__ == "__main__":
    main()
